"""Cost profiles measured on real hardware, for the simulator (and as a start-up guess when
calibration is not wanted). Milliseconds, as `CostModel` takes them.

H200_MOONDREAM2: the GPU fast path (`photon_core.fast.FastEngine`, fused Triton decode step,
graphed encoder, bf16), random weights of Moondream 2's real shapes, one NVIDIA H200.
Source: docs/benchmarks.md:
- decode step, graph replay, 2026-11-29 "Call 4, commit 3086a54": 1.002 / 1.102 / 1.191 ms at
  batch 1 / 2 / 4; batch 8: 1.354 ms graph replay, 1.463 ms pipelined (the loop the scheduler
  runs) -> 1.5 ms (~1.5x batch 1) taken here (2026-11-30 call 3: 0.988 / 1.300 ms at b=1 / 8);
- prompt prefill after the image prefix, graph replay (2026-11-29): T=8 2.86 ms, T=16 2.94 ms,
  T=32 3.49 ms -> 2.65 ms + 0.026 ms per token;
- encode of a 640x480 frame, 2026-11-30 call 2 (the encode path after issue 13's work):
  19.3 ms with the full overlap crops (9 crops), 9.3 ms with crops="global" (1 crop) ->
  6.8 ms + 2.5 ms per crop of the scheduler's crop estimate (5 for 640x480 overlap, 1 for
  global: the fit reproduces both measurements; the engine's real tiling there is 2x4 + 1
  global = 9 crops, the split only matters for other sizes). (2026-11-29: 21.9 ms overlap.)
- batched encode of n frames (`engine.encode_batch`, 2026-11-30 call 2): "saves 5-12 % per
  frame" (prefix prefill 5.38 / 9.42 / 18.42 ms for 1 / 2 / 4 frames) -> ENCODE_BATCH_GAIN
  0.12 for the simulator's BatchEncodeSimEngine (one call of n frames costs
  1 - 0.12 (n-1)/n of the frames one by one: 6 % at n=2, 9 % at n=4).
"""
from __future__ import annotations

from .cost_model import CostModel

H200_SOURCE = ("docs/benchmarks.md, H200 fast path: decode step 1.00/1.10/1.19/1.5 ms at "
               "b=1/2/4/8, prefill 2.65 ms + 0.026 ms/token, encode 640x480 19.3 ms (overlap) / "
               "9.3 ms (global), batched encode 6-9 % cheaper per frame")


def h200_moondream2(ema: float = 0.0) -> CostModel:
    return CostModel(encode_base_ms=6.8, encode_per_crop_ms=2.5, prefill_base_ms=2.65,
                     prefill_per_token_ms=0.026,
                     decode_step_ms={1: 1.00, 2: 1.10, 4: 1.19, 8: 1.50}, ema=ema)


PROFILES = {"h200": h200_moondream2}
# the engine of a profile has encode_batch, with this gain (see the module doc)
ENCODE_BATCH_GAIN = {"h200": 0.12}
