"""A decode step of the fused backend's state as one megakernel launch (plus the feedback
embedding launch before it): MegakernelStep(fd, st, b).step() ==
fd.feed(st, b); fd.decoder(...); row_advance(...); fd.head_pick("lm", st, b)
of fast/fused_backend.py, in one kernel (reference_step below is that sequence).
"""
from __future__ import annotations

import os

import torch

from ..ops.row_advance import row_advance
from .compiler import Compiled, compile_program
from .kernel import interpreted, launch
from .lowering import ProgramLowering
from .python_vm import PythonVM

UNROLL_ENV = int(os.environ.get("PHOTON_MK_UNROLL", "0"))


def sm_count(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def reference_step(fd, st, b: int, feed: bool = True) -> None:
    """What the megakernel computes, with the fused backend's own launches: (the feedback,)
    the decoder, the row advance, the lm head's greedy pick."""
    if feed:
        fd.feed(st, b)
    fd.decoder(st.pos[:b], b)
    row_advance(fd.x[:b], st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                st.kind[:b], st.first[:b], st.phase_next)
    fd.head_pick("lm", st, b)


class MegakernelStep:
    def __init__(self, fd, st, b: int, n_sm: int | None = None,
                 attn_per: int | None = None, gemv: str = "auto",
                 unroll: int | None = None, num_warps: int | None = None):
        """gemv: lowering.GEMV_CHOICES or "auto" (b=1: "fma", else "small": no register
        spills at 8 warps in sm_90 builds, bench/compile_megakernel.py); unroll: GEMV W
        tiles per group (None: PHOTON_MK_UNROLL, else 4 at b=1, 2 above)."""
        self.fd, self.st, self.b = fd, st, b
        if gemv == "auto":
            gemv = "fma" if b == 1 else "small"
        self.gemv = gemv
        self.unroll = unroll or (UNROLL_ENV or (4 if b == 1 else 2))
        self.num_warps = num_warps
        dev = fd.x.device
        if n_sm is None:
            n_sm = 1 if interpreted() else sm_count(dev)
        self.low = ProgramLowering(fd, st, b, n_sm, gemv)
        self.compiled: Compiled = compile_program(
            self.low.ops, self.low.buffers, b, self.low.shape, self.low.gemv_cfg, n_sm,
            st.hidden.dtype, attn_per)

    def feed(self) -> None:
        self.fd.feed(self.st, self.b)

    def run_kernel(self, **kw):
        """decoder + advance + lm greedy pick: the megakernel (no feed)."""
        kw.setdefault("unroll", self.unroll)
        kw.setdefault("num_warps", self.num_warps)
        return launch(self.compiled, self.low, **kw)

    def run_vm(self):
        """The same instructions through the Python twin."""
        return PythonVM(self.compiled, self.low).run()

    def step(self) -> None:
        self.feed()
        self.run_kernel()
