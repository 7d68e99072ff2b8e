"""A decode step of the fused backend's state as one megakernel launch (plus the feedback
embedding launch before it): MegakernelStep(fd, st, b).step() ==
fd.feed(st, b); fd.decoder(...); row_advance(...); fd.head_pick("lm", st, b)
of fast/fused_backend.py, in one kernel (reference_step below is that sequence).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..ops.row_advance import row_advance
from . import hybrid_kernel
from .compiler import Compiled, compile_program
from .hybrid_lowering import HybridLowering, is_hybrid
from .kernel import interpreted, launch
from .lowering import ProgramLowering, is_pipe, parse_gemv
from .python_vm import PythonVM

UNROLL_ENV = int(os.environ.get("PHOTON_MK_UNROLL", "0"))


@dataclass(frozen=True)
class Variant:
    """One build of the megakernel: the GEMV shapes (lowering.GEMV_CHOICES, "pipe*@RxK", or
    "auto"), warps, software-pipelining stages, register unroll of the non-pipe GEMVs (0:
    MegakernelStep's default), alignment hints, key splits per attention instruction
    (attn_per, 0: compiler.attn_splits_per_instr), programs per SM (per_sm: 2 = two
    persistent programs share each SM, twice the weight bytes in flight per SM where
    registers and shared memory allow two; a cooperative launch fails at once where they do
    not), the fill schedule (fill: compiler.compile_program's: the GEMV beside attention
    dealt out by the programs' free times, attention first in the queues), the pipe GEMVs'
    first weight tiles issued before their wait (pre, pipe* GEMVs only: kernel._gemv_pipe
    waits inside its first step; the same bits), the hybrid kernel's residual epilogue as
    relaxed atomic adds (red: hybrid_kernel._hgemv_epilogue's RED; the same bits), each
    instruction polling only the waits its program has not made yet (elide:
    compiler.elide_waits; the same bits), the next instruction's record prefetched into L1
    once the current one's inputs are acquired (rpf: kernel.py RPF; the same bits), a pipe
    GEMV block's bias and residual loaded at its first step, not in its epilogue (early:
    kernel._gemv_pipe EARLY; the same bits), a wait's counters polled by one thread then a
    CTA barrier (poll1: kernel._poll_one; the same bits), attention's key-split groups with
    the larger ones last (tail: compiler.split_groups; the same bits).
    Written "gemv/w8/s4/u2/a4/p2/fill/pre/red/elide/rpf/early/poll1/tail/noalign" (any
    order after the GEMV; "hoist", session 5's A/B flag for the fields read at an
    instruction's start, is how every build runs since and is accepted as a no-op). The
    parts measured slower or no better were removed in session 39 and are unknown parts
    now (kv2, pfN / pfnN, slN, split, apipe, parg, dyn, greedy:
    docs/dropped_experiments.md)."""
    gemv: str = "auto"
    warps: int = 8
    stages: int = 3
    unroll: int = 0
    align: bool = True
    attn_per: int = 0
    per_sm: int = 1
    fill: bool = False
    pre: bool = False
    red: bool = False
    elide: bool = False
    rpf: bool = False
    early: bool = False
    poll1: bool = False
    tail: bool = False
    # the on / off parts of a variant string, in the order str() writes them
    FLAGS = ("fill", "pre", "red", "elide", "rpf", "early", "poll1", "tail")

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        parts = spec.strip().split("/")
        kw: dict = {"gemv": parts[0]}
        if parts[0] != "auto":
            parse_gemv(parts[0])          # ValueError on an unknown GEMV choice
        for p in parts[1:]:
            for key, name in (("w", "warps"), ("a", "attn_per"), ("p", "per_sm"),
                              ("s", "stages"), ("u", "unroll")):
                if p.startswith(key) and p[len(key):].isdigit():
                    kw[name] = int(p[len(key):])
                    break
            else:
                if p == "noalign":
                    kw["align"] = False
                elif p in cls.FLAGS:
                    kw[p] = True
                elif p == "hoist":
                    pass
                else:
                    raise ValueError(f"megakernel variant {spec!r}: unknown part {p!r}")
        if kw.get("pre") and (parts[0] == "auto" or not is_pipe(parts[0])):
            raise ValueError(f"megakernel variant {spec!r}: pre needs a pipe* GEMV")
        return cls(**kw)

    def launch_kw(self) -> dict:
        """kernel.launch's keywords this variant sets (warps and unroll aside: MegakernelStep
        resolves those)."""
        return dict(num_stages=self.stages, align=self.align, pre=self.pre, rpf=self.rpf,
                    early=self.early, poll1=self.poll1)

    def __str__(self) -> str:
        s = f"{self.gemv}/w{self.warps}/s{self.stages}"
        s += f"/u{self.unroll}" if self.unroll else ""
        s += f"/a{self.attn_per}" if self.attn_per else ""
        s += f"/p{self.per_sm}" if self.per_sm != 1 else ""
        s += "".join(f"/{f}" for f in self.FLAGS if getattr(self, f))
        return s + ("" if self.align else "/noalign")


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): the persistent grid's size."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def reference_step(fd, st, b: int, feed: bool = True) -> None:
    """What the megakernel computes, with the fused backend's own launches: (the feedback,)
    the decoder, the row advance, the lm head's greedy pick."""
    if feed:
        fd.feed(st, b)
    fd.decoder(st.pos[:b], b, st.pos_offset[:b], st.active[:b])
    row_advance(fd.x[:b], st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                st.kind[:b], st.first[:b], st.phase_next)
    fd.head_pick("lm", st, b)


class MegakernelStep:
    def __init__(self, fd, st, b: int, n_sm: int | None = None,
                 attn_per: int | None = None, gemv: str | None = None,
                 unroll: int | None = None, num_warps: int | None = None,
                 variant: Variant | str | None = None, head: bool = True):
        """variant: a Variant (or its string); gemv / unroll / num_warps override its fields.
        gemv: lowering.GEMV_CHOICES or "auto" (b=1: "fma", else "small": no register
        spills at 8 warps in sm_90 builds, bench/compile_megakernel.py); unroll: GEMV W
        tiles per group (None: PHOTON_MK_UNROLL, else 4 at b=1, 2 above). head=False: no
        lm pick at the end (the engine's forward piece: megakernel_backend.py)."""
        self.fd, self.st, self.b = fd, st, b
        v = Variant.parse(variant) if isinstance(variant, str) else (variant or Variant())
        gemv = gemv or v.gemv
        hybrid_gemv = gemv          # (the hybrid kernel's tiles: hybrid_lowering.gemv_tile)
        if gemv == "auto":
            gemv = "fma" if b == 1 else "small"
        self.gemv = gemv
        self.unroll = unroll or v.unroll or (UNROLL_ENV or (4 if b == 1 else 2))
        self.num_warps = num_warps or (v.warps if variant is not None else None)
        self.variant = v
        dev = fd.x.device
        if n_sm is None:
            n_sm = 1 if interpreted() else sm_count(dev) * v.per_sm
        # a hybrid program (Gated DeltaNet layers: Qwen 3.5) has its own lowering and kernel
        # (hybrid_lowering.py, hybrid_kernel.py; its GEMVs take one tile shape: the variant's
        # GEMV field's, "auto" / "pipe[_fma][@RxK]", and its stages; unroll does not apply;
        # attn_per / the variant's "aN": key splits per (row, head))
        self.hybrid = is_hybrid(fd)
        self.low = HybridLowering(fd, st, b, n_sm, head, hybrid_gemv,
                                  attn_splits=attn_per or v.attn_per or None) \
            if self.hybrid else ProgramLowering(fd, st, b, n_sm, gemv, head)
        self.compiled: Compiled = compile_program(
            self.low.ops, self.low.buffers, b, self.low.shape, self.low.gemv_cfg, n_sm,
            st.hidden.dtype, attn_per or v.attn_per or None, v.fill, v.per_sm, v.elide,
            v.tail)
        # (the hybrid kernel's alignment hint, decided once here: the launch, captured in a
        # CUDA graph, reads nothing back from the device)
        self.gemv_aligned = self.hybrid and hybrid_kernel.gemv_aligned(self.compiled, self.low)

    def feed(self) -> None:
        self.fd.feed(self.st, self.b)
        pre = getattr(self.low, "pre", None)
        if pre is not None:       # (Gemma 4's per-layer input: the fused backend's launch)
            pre(self.b, {})

    def run_kernel(self, **kw):
        """decoder + advance + lm greedy pick: the megakernel (no feed)."""
        if self.hybrid:     # (the variant's warps, stages, pre, red, rpf, poll1 apply)
            v = self.variant
            return hybrid_kernel.launch(self.compiled, self.low,
                                        num_warps=kw.get("num_warps") or self.num_warps or 8,
                                        num_stages=kw.get("num_stages") or v.stages,
                                        aligned=self.gemv_aligned, pre=kw.get("pre", v.pre),
                                        trace=kw.get("trace"), red=kw.get("red", v.red),
                                        rpf=kw.get("rpf", v.rpf),
                                        poll1=kw.get("poll1", v.poll1))
        kw.setdefault("unroll", self.unroll)
        kw.setdefault("num_warps", self.num_warps)
        v = self.variant
        if v != Variant():
            for k, x in v.launch_kw().items():
                kw.setdefault(k, x)
        return launch(self.compiled, self.low, **kw)

    def run_vm(self):
        """The same instructions through the Python twin."""
        return PythonVM(self.compiled, self.low).run()

    def step(self) -> None:
        self.feed()
        self.run_kernel()
