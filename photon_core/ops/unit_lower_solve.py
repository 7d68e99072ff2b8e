"""Batched solve of unit lower-triangular systems (I + L) X = R, torch reference and Triton kernel
side by side: the chunked delta rule's "UT transform" (ops/gated_delta_rule.py), one system per
(chunk, value head) of C x C (C a multiple of 16, 64 in the encode) with [C, W] right-hand
sides.

Reference: torch.linalg.solve_triangular(a, r, upper=False, unitriangular=True) (the diagonal
of `a` is read as 1, its upper triangle ignored). On the GPU that is cuBLAS's batched trsm:
~37 us per layer for Qwen 3.5 0.8B's 640x480 prefix (80 systems), latency of its sequential
substitution, 0.67 ms of the encode (docs/benchmarks.md, session 16).

Kernel: one program per (system, COLUMNS columns of R), blocked forward substitution over
block rows of 16:
    X_i = D_i^-1 (R_i - sum_{j<i} L_ij X_j)
with each diagonal block's inverse (I + L_ii)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) (L
strictly lower 16 x 16: L^16 = 0, so the product is the whole Neumann series, exact up to
rounding), every product a 16-row tl.dot in fp32 (input_precision "ieee": the sums of trsm's
substitution, in another order - close, not bitwise). A block row of X is stored once computed
and read back by the next block rows of the same program (a CTA barrier between).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

BLOCK = 16          # rows per diagonal block (tl.dot's smallest M / K)
# right-hand-side columns per program (each program of a system inverts the diagonal blocks
# itself); Qwen 3.5 0.8B's encode (18 launches of 80 systems x 256 columns) on the H200:
# 0.242 ms with 64, 0.330 with 32, 0.594 with all 256 in one program (session 18 calls 3-5)
COLUMNS = 64


def unit_lower_solve_reference(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """a [..., C, C], r [..., C, W] -> X [..., C, W] with (I + strictly_lower(a)) X = r."""
    return torch.linalg.solve_triangular(a, r, upper=False, unitriangular=True)


@triton.jit
def _diag_inverse(a, i0, C: tl.constexpr, BC: tl.constexpr, NSQ: tl.constexpr):
    """(I + L)^-1 of the diagonal block at rows / columns [i0, i0 + BC) of the C x C system
    `a` (its strictly lower part L): the Neumann series as (I - L)(I + L^2)(I + L^4)...,
    NSQ + 1 = log2(BC) factors."""
    r = tl.arange(0, BC)
    blk = tl.load(a + (i0 + r)[:, None] * C + (i0 + r)[None, :])
    low = tl.where(r[:, None] > r[None, :], blk, 0.0)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    inv = eye - low
    p = low
    for _ in tl.static_range(NSQ):                    # BC = 16: L^2, L^4, L^8
        p = tl.dot(p, p, input_precision="ieee")
        inv = tl.dot(inv, eye + p, input_precision="ieee")
    return inv


@triton.jit
def _unit_lower_solve_kernel(a_ptr, r_ptr, x_ptr, x2_ptr, W, SPLIT, C: tl.constexpr,
                             BC: tl.constexpr, NSQ: tl.constexpr, WB: tl.constexpr):
    """X's columns [0, SPLIT) go to x (rows SPLIT wide), the rest to x2 (rows W - SPLIT wide);
    SPLIT a multiple of WB (SPLIT = W: all to x)."""
    s = tl.program_id(0).to(tl.int64)
    a = a_ptr + s * C * C
    r = r_ptr + s * C * W
    c0 = tl.program_id(1) * WB
    if c0 < SPLIT:
        x = x_ptr + s * C * SPLIT
        xw = SPLIT
        xc0 = c0
    else:
        x = x2_ptr + s * C * (W - SPLIT)
        xw = W - SPLIT
        xc0 = c0 - SPLIT
    rows = tl.arange(0, BC)
    cw = tl.arange(0, WB)
    cm = (c0 + cw < W)[None, :]
    for i in tl.static_range(C // BC):
        acc = tl.load(r + (i * BC + rows)[:, None] * W + (c0 + cw)[None, :], mask=cm, other=0.0)
        for j in tl.static_range(i):
            lij = tl.load(a + (i * BC + rows)[:, None] * C + (j * BC + rows)[None, :])
            xj = tl.load(x + (j * BC + rows)[:, None] * xw + (xc0 + cw)[None, :], mask=cm,
                         other=0.0)
            acc -= tl.dot(lij, xj, input_precision="ieee")
        xi = tl.dot(_diag_inverse(a, i * BC, C, BC, NSQ), acc, input_precision="ieee")
        tl.store(x + (i * BC + rows)[:, None] * xw + (xc0 + cw)[None, :], xi, mask=cm)
        tl.debug_barrier()          # this block row is read back by the next ones


def unit_lower_solve_triton(a: torch.Tensor, r: torch.Tensor, split: int | None = None):
    """As unit_lower_solve_reference for fp32 a [..., C, C] and r [..., C, W] (C a multiple of
    16; both made contiguous) -> a new fp32 X. split: -> (X[..., :split], X[..., split:]) as
    two contiguous tensors, written so by the kernel (the delta rule's u and w: no copies)."""
    c, w = a.shape[-1], r.shape[-1]
    if a.dtype != torch.float32 or r.dtype != torch.float32 or a.shape[-2] != c or \
            c % BLOCK or r.shape[:-1] != a.shape[:-1]:
        raise ValueError(f"unit_lower_solve_triton: a {tuple(a.shape)} {a.dtype}, r "
                         f"{tuple(r.shape)} {r.dtype}: fp32 [..., C, C] and [..., C, W] with C "
                         f"a multiple of {BLOCK} expected")
    a, r = a.contiguous(), r.contiguous()
    wb = min(COLUMNS, max(16, triton.next_power_of_2(w)))
    if split is not None and (split % wb or not 0 < split < w):
        x = unit_lower_solve_triton(a, r)            # (a split inside a program's columns)
        return x[..., :split].contiguous(), x[..., split:].contiguous()
    cut = w if split is None else split
    x = r.new_empty(*r.shape[:-1], cut)
    x2 = r.new_empty(*r.shape[:-1], w - cut) if split is not None else x
    systems = a.numel() // (c * c)
    if systems:
        _unit_lower_solve_kernel[(systems, triton.cdiv(w, wb))](
            a, r, x, x2, w, cut, C=c, BC=BLOCK, NSQ=BLOCK.bit_length() - 2, WB=wb,
            num_warps=4)
    return x if split is None else (x, x2)


__all__ = ["BLOCK", "unit_lower_solve_reference", "unit_lower_solve_triton"]
