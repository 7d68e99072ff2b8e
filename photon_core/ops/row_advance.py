"""The end of a decode step in one launch: every active row stores its new hidden state and
advances its position and phase (row_advance_reference in torch is ~12 kernels).

grid (rows, dim / BLOCK_D). Row r, if active[r]:
  hidden[r] = x[r] rounded to hidden's dtype      (every program, its channel block)
  pos[r] += 1; first[r] = 0;                      (the channel-block-0 program only)
  phase[r] = phase_next[phase[r], kind[r]]        (the family's skill-protocol table [P, K])
Inactive rows are left exactly as they were.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def _advance_kernel(x_ptr, stride_x, h_ptr, stride_h, active_ptr, pos_ptr, phase_ptr,
                    kind_ptr, first_ptr, table_ptr, n_kinds, D, BLOCK_D: tl.constexpr,
                    GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    act = tl.load(active_ptr + row)
    if act != 0:
        offs = blk * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
        tl.store(h_ptr + row * stride_h + offs, x.to(h_ptr.dtype.element_ty), mask=ok)
        if blk == 0:
            tl.store(pos_ptr + row, tl.load(pos_ptr + row) + 1)
            ph = tl.load(phase_ptr + row)
            kind = tl.load(kind_ptr + row)
            tl.store(phase_ptr + row, tl.load(table_ptr + ph * n_kinds + kind))
            tl.store(first_ptr + row, tl.zeros([], dtype=tl.uint8))


def row_advance(x: torch.Tensor, hidden: torch.Tensor, active: torch.Tensor, pos: torch.Tensor,
                phase: torch.Tensor, kind: torch.Tensor, first: torch.Tensor,
                phase_next: torch.Tensor, block_d: int = 512, pdl: bool = False) -> None:
    """x [b, dim] (the decoder's output), the first b rows of the StepState tensors
    (bool tensors are read/written as uint8), phase_next [P, K] int64 contiguous."""
    b, d = x.shape
    assert x.stride(1) == 1 and hidden.stride(1) == 1 and phase_next.is_contiguous()
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _advance_kernel[(b, triton.cdiv(d, block_d))](
        x, x.stride(0), hidden, hidden.stride(0), active.view(torch.uint8), pos, phase,
        kind, first.view(torch.uint8), phase_next, phase_next.shape[1], d, BLOCK_D=block_d,
        GDC=gdc, num_warps=4, **launch_kw)


def row_advance_reference(x: torch.Tensor, hidden: torch.Tensor, active: torch.Tensor,
                          pos: torch.Tensor, phase: torch.Tensor, kind: torch.Tensor,
                          first: torch.Tensor, phase_next: torch.Tensor) -> None:
    """The same in torch, in place."""
    hidden.copy_(torch.where(active[:, None], x.to(hidden.dtype), hidden))
    pos += active.long()
    phase.copy_(torch.where(active, phase_next[phase, kind], phase))
    first &= ~active
