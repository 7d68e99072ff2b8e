"""Per-step GPU idle time: the gap between consecutive decode steps on the GPU timeline.

A timing-enabled CUDA event is recorded on the compute stream just before a step's first
piece and just after its last; idle(t) = start(t) - end(t-1), read once step t is committed
(both events have completed by then, so reading them never blocks). Events live in a ring
of 8 pairs, so the pair of step t-1 is not re-recorded before it is read. Gaps where the
decoder had nothing queued (between requests) are excluded by `reset_chain()`. On the CPU
there is no device timeline and nothing is recorded.
"""
from __future__ import annotations

import statistics

import torch

RING = 8


class GpuIdleMeter:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ring = ([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(RING)] if self.cuda else [])
        self.gaps_ms: list[float] = []
        self.step_ms: list[float] = []
        self._chained: set[int] = set()   # steps whose predecessor was queued back-to-back

    def start(self, step: int, chained: bool) -> None:
        if self.cuda:
            self.ring[step % RING][0].record()
        if chained:
            self._chained.add(step)

    def end(self, step: int) -> None:
        if self.cuda:
            self.ring[step % RING][1].record()

    def committed(self, step: int) -> None:
        if not self.cuda:
            return
        s, e = self.ring[step % RING]
        self.step_ms.append(s.elapsed_time(e))
        if step in self._chained:
            self._chained.discard(step)
            prev_end = self.ring[(step - 1) % RING][1]
            self.gaps_ms.append(prev_end.elapsed_time(s))

    def reset(self) -> None:
        self.gaps_ms.clear()
        self.step_ms.clear()

    def summary(self) -> dict:
        def stats(xs):
            if not xs:
                return {}
            xs = sorted(xs)
            return {"n": len(xs), "mean_ms": statistics.fmean(xs),
                    "median_ms": xs[len(xs) // 2], "p90_ms": xs[int(0.9 * (len(xs) - 1))],
                    "max_ms": xs[-1]}
        return {"gpu_idle_per_step": stats(self.gaps_ms), "gpu_step": stats(self.step_ms)}
