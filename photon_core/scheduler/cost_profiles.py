"""Cost profiles measured on real hardware, for the simulator (and as a start-up guess when
calibration is not wanted). Milliseconds, as `CostModel` takes them.

H200_MOONDREAM2: the GPU fast path (`photon_core.fast.FastEngine`, fused Triton decode step,
graphed encoder, bf16), random weights of Moondream 2's real shapes, one NVIDIA H200.
Source: docs/benchmarks.md:
- decode step, graph replay, with the default engine on Hopper (megakernel "auto": batch 1
  on the megakernel, larger buckets on the fused split-K graph): 0.91 ms at batch 1 (2026-12-01
  session 10 call 10: 0.912; session 9: 0.908), 1.11 / 1.20 ms at batch 2 / 4 (session 9 call
  16: 1.111 / 1.201); batch 8: 1.376 ms graph replay (same call) plus the pipelined loop's
  ~0.1 ms at that size (2026-11-29: 1.354 replay, 1.463 pipelined) -> 1.5 ms. (Before:
  1.00 / 1.10 / 1.19 / 1.5 ms, 2026-11-29 "Call 4, commit 3086a54".)
- prompt prefill after the image prefix, graph replay (2026-12-01 session 10 call 3: the
  attention over blocks of prompt tokens): T=8 1.197 ms, T=16 1.251 ms -> 1.143 ms +
  0.00675 ms per token (session 6: 0.97 + 0.041; 2026-11-29: 2.65 + 0.026);
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

H200_SOURCE = ("docs/benchmarks.md, H200 fast path: decode step 0.91/1.11/1.20/1.5 ms at "
               "b=1/2/4/8, prefill 1.143 ms + 0.00675 ms/token, encode 640x480 16.2 ms (overlap) / "
               "6.4 ms (global), batched encode 2.5-3.8 % cheaper per frame")


def h200_moondream2(ema: float = 0.0) -> CostModel:
    return CostModel(encode_base_ms=4.0, encode_per_crop_ms=2.445, prefill_base_ms=1.143,
                     prefill_per_token_ms=0.00675,
                     decode_step_ms={1: 0.91, 2: 1.11, 4: 1.20, 8: 1.50}, ema=ema)


PROFILES = {"h200": h200_moondream2}
# the engine of a profile has encode_batch, with this gain (see the module doc)
ENCODE_BATCH_GAIN = {"h200": 0.05}
