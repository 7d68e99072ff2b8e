"""Cost profiles measured on real hardware, for the simulator (and as a start-up guess when
calibration is not wanted). Milliseconds, as `CostModel` takes them.

H200_MOONDREAM2: the GPU fast path (`photon_core.fast.FastEngine`, fused Triton decode step,
graphed encoder, bf16), random weights of Moondream 2's real shapes, one NVIDIA H200.
Source: docs/benchmarks.md:
- decode step, graph replay, 2026-11-29 "Call 4, commit 3086a54": 1.002 / 1.102 / 1.191 ms at
  batch 1 / 2 / 4; batch 8: 1.354 ms graph replay, 1.463 ms pipelined (the loop the scheduler
  runs) -> 1.5 ms (~1.5x batch 1) taken here (2026-11-30 call 3: 0.988 / 1.300 ms at b=1 / 8);
- prompt prefill after the image prefix, graph replay (2026-11-30 session 6 call 1: the
  decode kernels over the prompt): T=8 1.30 ms, T=16 1.63 ms -> 0.97 ms + 0.041 ms per token
  (2026-11-29, before: 2.65 ms + 0.026 ms per token);
- encode of a 640x480 frame, 2026-11-30 session 6 call 10: 16.21 ms with the full overlap
  crops (9 crops), 6.43 ms with crops="global" (1 crop) -> 4.0 ms + 2.445 ms per crop of the
  scheduler's crop estimate (5 for 640x480 overlap, 1 for global: the fit reproduces both
  measurements; the engine's real tiling there is 2x4 + 1 global = 9 crops, the split only
  matters for other sizes). (2026-11-30 call 2: 19.3 / 9.3 ms; 2026-11-29: 21.9 ms overlap.)
- batched encode of n frames (`engine.encode_batch`, 2026-11-30 session 6 call 10): 4 frames
  15.58 ms per frame vs 16.21 ms one by one (3.9 %) -> ENCODE_BATCH_GAIN 0.05 for the
  simulator's BatchEncodeSimEngine (one call of n frames costs 1 - 0.05 (n-1)/n of the frames
  one by one: 2.5 % at n=2, 3.8 % at n=4). (2026-11-30 call 2: 5-12 %, gain 0.12.)
"""
from __future__ import annotations

from .cost_model import CostModel

H200_SOURCE = ("docs/benchmarks.md, H200 fast path: decode step 1.00/1.10/1.19/1.5 ms at "
               "b=1/2/4/8, prefill 0.97 ms + 0.041 ms/token, encode 640x480 16.2 ms (overlap) / "
               "6.4 ms (global), batched encode 2.5-3.8 % cheaper per frame")


def h200_moondream2(ema: float = 0.0) -> CostModel:
    return CostModel(encode_base_ms=4.0, encode_per_crop_ms=2.445, prefill_base_ms=0.97,
                     prefill_per_token_ms=0.041,
                     decode_step_ms={1: 1.00, 2: 1.10, 4: 1.19, 8: 1.50}, ema=ema)


PROFILES = {"h200": h200_moondream2}
# the engine of a profile has encode_batch, with this gain (see the module doc)
ENCODE_BATCH_GAIN = {"h200": 0.05}
