"""Cost profiles measured on real hardware, for the simulator (and as a start-up guess when
calibration is not wanted). Milliseconds, as `CostModel` takes them.

H200_MOONDREAM2: the GPU fast path (`photon_core.fast.FastEngine`, fused Triton decode step,
graphed encoder, bf16), random weights of Moondream 2's real shapes, one NVIDIA H200.
Source: docs/benchmarks.md (2026-11-29):
- decode step, graph replay, "Call 4, commit 3086a54": 1.002 / 1.102 / 1.191 ms at batch
  1 / 2 / 4; batch 8: 1.354 ms graph replay, 1.463 ms pipelined (the loop the scheduler
  runs) -> 1.5 ms (~1.5x batch 1) taken here;
- prompt prefill after the image prefix, graph replay: T=8 2.86 ms, T=16 2.94 ms, T=32
  3.49 ms -> 2.65 ms + 0.026 ms per token;
- encode of a 640x480 frame: 21.9 ms (same call; issue 13: crops 0.6 ms, vision 13.5-14 ms
  as a graph, image-prefix prefill 7.5 ms) -> 8.1 ms + 2.76 ms per crop of the scheduler's
  crop estimate (5 for 640x480; the engine's real tiling there is 2x4 + 1 global = 9
  crops, the split only matters for other sizes);
- batched encode of n frames: not measured yet (the engine has no batched encode today):
  no gain assumed (`encode_batch_factor` empty = n x one frame).
"""
from __future__ import annotations

from .cost_model import CostModel

H200_SOURCE = ("docs/benchmarks.md 2026-11-29, H200 fast path: decode step 1.00/1.10/1.19/1.5 ms "
               "at b=1/2/4/8, prefill 2.65 ms + 0.026 ms/token, encode 640x480 21.9 ms")


def h200_moondream2(ema: float = 0.0) -> CostModel:
    return CostModel(encode_base_ms=8.1, encode_per_crop_ms=2.76, prefill_base_ms=2.65,
                     prefill_per_token_ms=0.026,
                     decode_step_ms={1: 1.00, 2: 1.10, 4: 1.19, 8: 1.50}, ema=ema)


PROFILES = {"h200": h200_moondream2}
