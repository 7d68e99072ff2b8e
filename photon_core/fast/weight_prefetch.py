"""A captured decode piece with the L2 weight-prefetch stream beside it (ops/l2_prefetch.py).

    wp = WeightPrefetch(device, window_bytes=16 << 20)
    g = capture_graph(wp.around(piece))     # the graph: counter zeroed, then fork:
    wp.fill()                               #   the piece (its GEMVs report their reads) |
                                            #   the prefetcher over the piece's weights; join
The prefetcher's table (the weights of the piece's GEMVs, in launch order, recorded while
the piece is captured) is written into a preallocated device tensor after the capture, so
the capture itself copies nothing from the host. A piece whose GEMVs read nothing (e.g. the
megakernel's forward) gets no prefetcher: the fork and join are empty.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ops import l2_prefetch as l2


class WeightPrefetch:
    def __init__(self, device, window_bytes: int = 16 << 20, programs: int = 16,
                 chunk: int = 64 << 10, max_segments: int = 4096):
        self.window_bytes = window_bytes
        self.programs = programs
        self.chunk = chunk
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.table = torch.zeros(max_segments, 3, dtype=torch.int64, device=device)
        self.recorder = l2.Recorder(self.counter)
        self.side = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None

    def around(self, piece: Callable[[], object]) -> Callable[[], object]:
        """piece wrapped for capture on the current (capture) stream."""
        def run():
            self.recorder.segments.clear()
            self.counter.zero_()
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with l2.recording(self.recorder):
                out = piece()
            n = len(self.recorder.segments)
            if 0 < n <= self.table.shape[0]:
                with torch.cuda.stream(self.side):
                    l2.launch_stream(self.table[:n], self.counter, self.window_bytes,
                                     self.programs, self.chunk)
            main.wait_stream(self.side)
            return out
        return run

    def fill(self) -> int:
        """Write the recorded table (after the capture); -> its segment count."""
        n = len(self.recorder.segments)
        if 0 < n <= self.table.shape[0]:
            self.table[:n].copy_(self.recorder.table("cpu"))
        return n

    @property
    def weight_bytes(self) -> int:
        return sum(s[1] for s in self.recorder.segments)
