"""Greedy picks in one launch: argmax over each row's logits (or each of its segments), with
the text rule of the reference applied on the fly: after a row's first text pick the answer
marker is never picked again (decode_step._lm_logits does it with ~6 torch kernels, then
argmax).

grid (rows, segments): out[row, col0 + segment] = index of the first maximum of
x[row, segment * L : (segment + 1) * L] (torch.argmax's tie rule); with MASK, column
`mask_col` counts as -inf for rows whose phase is `mask_phase` (the family's text phase, given
by its step spec: Moondream's 0) and whose `first` flag is clear.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def _argmax_kernel(x_ptr, stride_x, L, out_ptr, stride_out, col0, mask_col, phase_ptr,
                   first_ptr, MASK: tl.constexpr, BLOCK: tl.constexpr,
                   MASK_PHASE: tl.constexpr = 0, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    base = x_ptr + row * stride_x + seg * L
    drop = False
    if MASK:
        drop = (tl.load(phase_ptr + row) == MASK_PHASE) & (tl.load(first_ptr + row) == 0)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], dtype=tl.int64)
    for start in range(0, L, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(base + offs, mask=offs < L, other=float("-inf")).to(tl.float32)
        if MASK:
            v = tl.where((offs == mask_col) & drop, float("-inf"), v)
        m = tl.max(v, axis=0)
        i = tl.argmax(v, axis=0).to(tl.int64) + start
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row * stride_out + col0 + seg, best_i)


def masked_argmax(x: torch.Tensor, out: torch.Tensor, col0: int, segments: int = 1,
                  mask_col: int | None = None, phase: torch.Tensor | None = None,
                  first: torch.Tensor | None = None, block: int = 4096,
                  mask_phase: int = 0, pdl: bool = False) -> torch.Tensor:
    """x [b, segments * L] -> out[:b, col0 : col0 + segments] (int64, row stride free)."""
    b, n = x.shape
    assert x.stride(1) == 1 and n % segments == 0 and out.dtype == torch.int64
    length = n // segments
    masked = mask_col is not None
    block = min(block, triton.next_power_of_2(length))
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _argmax_kernel[(b, segments)](
        x, x.stride(0), length, out, out.stride(0), col0, mask_col if masked else -1,
        phase if masked else out, first.view(torch.uint8) if masked else out,
        MASK=masked, BLOCK=block, MASK_PHASE=mask_phase, GDC=gdc,
        num_warps=8 if block >= 4096 else 4, **launch_kw)
    return out


def masked_argmax_reference(x: torch.Tensor, out: torch.Tensor, col0: int, segments: int = 1,
                            mask_col: int | None = None, phase: torch.Tensor | None = None,
                            first: torch.Tensor | None = None,
                            mask_phase: int = 0) -> torch.Tensor:
    """The same picks in torch (the answer-marker column masked on rows of phase mask_phase
    after their first pick)."""
    b, n = x.shape
    if mask_col is not None:
        x = x.clone()
        col = x[:, mask_col]
        x[:, mask_col] = torch.where((phase == mask_phase) & ~first, torch.full_like(col, float("-inf")),
                                     col)
    out[:b, col0:col0 + segments] = x.view(b, segments, n // segments).argmax(dim=-1)
    return out
