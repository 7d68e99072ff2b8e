"""Programmatic dependent launch (PDL, Hopper and later) for the ops' kernels.

A kernel launched with launch_pdl=True may start while the kernel before it in the stream is
still running (once every program of that one has called gdc_launch_dependents, or ended).
So each such kernel:
  - calls pdl_launch_dependents(GDC) (lets the NEXT kernel launch early): first, or - a
    kernel that streams weights (the GEMV), with LATE_TRIGGER - after its main loop, so
    the next kernel's programs launch (and load their first weights) during this one's
    epilogue instead of sitting on the SMs beside its whole run (and the kernel after
    that one launching as early, and so on down the stream),
  - reads only constant tensors (weights) before pdl_wait(GDC),
  - calls pdl_wait(GDC) unconditionally, in every program, before reading or writing anything
    an earlier kernel writes (it returns once the previous kernel has finished and its
    memory is visible; as that kernel waited for its own predecessor, all of them are done).
The ops' wrappers take `pdl=` (the fused backend passes EngineOptions.pdl) and launch with
pdl_launch(pdl, tensor): GDC (the griddepcontrol instructions + launch_pdl) only on CUDA with
a Triton that has them (triton.language.extra.cuda.gdc_*); PDL (the kernel's PDL code shape,
e.g. the GEMV's first weight tile loaded before the wait) whenever the flag is on and the
kernel runs, so under TRITON_INTERPRET=1 the PDL code shape runs too (minus the instructions,
which the interpreter does not have) and a CPU test compares it with the plain one.
"""
from __future__ import annotations

import os

from ._triton import HAVE_TRITON, tl, triton

# the GEMV's trigger after its K loop (False: at its start, sessions 3-11's form, measured
# slower than no PDL at all; bench/ab_switch.py --toggle photon_core.ops.pdl:LATE_TRIGGER=0)
LATE_TRIGGER = True

HAVE_GDC = False
if HAVE_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        HAVE_GDC = True
    except Exception:  # pragma: no cover - older triton
        HAVE_GDC = False


if HAVE_GDC:
    @triton.jit
    def pdl_wait(GDC: tl.constexpr):
        if GDC:
            gdc_wait()

    @triton.jit
    def pdl_launch_dependents(GDC: tl.constexpr):
        if GDC:
            gdc_launch_dependents()
else:
    @triton.jit
    def pdl_wait(GDC: tl.constexpr):
        pass

    @triton.jit
    def pdl_launch_dependents(GDC: tl.constexpr):
        pass


_CAPABLE: dict = {}


def gdc_available(t) -> bool:
    """griddepcontrol can be used for kernels on t's device: CUDA, compute capability >= 9,
    a Triton with the gdc functions, not the interpreter."""
    if not (HAVE_GDC and getattr(t, "is_cuda", False)
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    dev = t.device.index
    if dev not in _CAPABLE:
        import torch
        _CAPABLE[dev] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _CAPABLE[dev]


def pdl_launch(flag: bool, t) -> tuple[bool, bool, dict]:
    """-> (PDL code shape, GDC instructions, extra launch kwargs) for a kernel on t's device."""
    if not flag:
        return False, False, {}
    gdc = gdc_available(t)
    return True, gdc, ({"launch_pdl": True} if gdc else {})
