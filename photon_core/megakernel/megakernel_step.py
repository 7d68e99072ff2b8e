"""A decode step of the fused backend's state as one megakernel launch (plus the feedback
embedding launch before it): MegakernelStep(fd, st, b).step() ==
fd.feed(); fd.decoder(); fd.advance(); fd.lm_greedy()  of fused_step.py, in one kernel.
"""
from __future__ import annotations

import torch

from .compiler import Compiled, compile_program
from .kernel import interpreted, launch
from .lowering_moondream import MoondreamLowering
from .python_vm import PythonVM


def sm_count(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class MegakernelStep:
    def __init__(self, fd, st, b: int, n_sm: int | None = None):
        self.fd, self.st, self.b = fd, st, b
        self.low = MoondreamLowering(fd, st, b)
        dev = fd.x.device
        if n_sm is None:
            n_sm = 1 if interpreted() else sm_count(dev)
        self.compiled: Compiled = compile_program(
            self.low.ops, self.low.buffers, b, self.low.shape, self.low.gemv_cfg, n_sm,
            fd.x.dtype if fd.h.dtype == torch.float32 else fd.h.dtype)

    def feed(self) -> None:
        self.fd.feed(self.st.out, self.st.phase, self.b)

    def run_kernel(self, **kw):
        """decoder + advance + lm greedy pick: the megakernel (no feed)."""
        return launch(self.compiled, self.low, **kw)

    def run_vm(self):
        """The same instructions through the Python twin."""
        return PythonVM(self.compiled, self.low).run()

    def step(self) -> None:
        self.feed()
        self.run_kernel()
