"""Greedy picks in one launch: argmax over each row's logits (or each of its segments), with
the text rule of the reference applied on the fly: after a row's first text pick the answer
marker is never picked again (decode_step._lm_logits does it with ~6 torch kernels, then
argmax).

grid (rows, segments): out[row, col0 + segment] = index of the first maximum of
x[row, segment * L : (segment + 1) * L] (torch.argmax's tie rule); with MASK, column
`mask_col` counts as -inf for rows whose phase is `mask_phase` (the family's text phase, given
by its step spec: Moondream's 0) and whose `first` flag is clear.

Long rows (a segment of SPLIT_MIN logits or more: Qwen 3.5's 248,320-token and Gemma 4's
262,144-token vocabularies) take two launches instead: grid (rows, segments, chunks of CHUNK)
for each chunk's first maximum, then one program per (row, segment) picks the first chunk
holding the largest (the same index: first maximum overall). One program walking 248,320
logits took 78 us on the H200 (bench/bench_qwen3_5_fast.py, docs/benchmarks.md session 10).
"""
from __future__ import annotations

import torch
from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


SPLIT_MIN, CHUNK = 32768, 8192


@triton.jit
def first_max_step(v, start, best, best_i, AXIS: tl.constexpr):
    """One block of values v (columns start + 0.. along AXIS) into the running first maximum
    (best, best_i): the block's first largest value, taken only where strictly larger, so
    blocks walked in column order keep the first column of the overall maximum."""
    m = tl.max(v, axis=AXIS)
    i = tl.argmax(v, axis=AXIS).to(tl.int64) + start
    better = m > best
    return tl.where(better, m, best), tl.where(better, i, best_i)


@triton.jit
def _first_max(base, lo, hi, mask_col, drop, MASK: tl.constexpr, BLOCK: tl.constexpr):
    """(value, index) of the first maximum of base[lo:hi] (index -> 0 if all are -inf)."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], dtype=tl.int64)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        if MASK:
            v = tl.where((offs == mask_col) & drop, float("-inf"), v)
        best, best_i = first_max_step(v, start, best, best_i, 0)
    return best, best_i


@triton.jit
def _argmax_kernel(x_ptr, stride_x, L, chunk, out_ptr, stride_out, col0, pv_ptr, pi_ptr,
                   mask_col, phase_ptr, first_ptr, MASK: tl.constexpr, BLOCK: tl.constexpr,
                   CHUNKED: tl.constexpr = False, MASK_PHASE: tl.constexpr = 0,
                   GDC: tl.constexpr = False):
    """Program (row, segment[, chunk]): the first maximum of the segment -> out, or with
    CHUNKED of its chunk-th `chunk` logits -> the partials pv / pi for the merge."""
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    drop = False
    if MASK:
        drop = (tl.load(phase_ptr + row) == MASK_PHASE) & (tl.load(first_ptr + row) == 0)
    base = x_ptr + row * stride_x + seg * L
    if CHUNKED:
        c = tl.program_id(2)
        lo = c * chunk
        best, best_i = _first_max(base, lo, tl.minimum(lo + chunk, L), mask_col, drop, MASK,
                                  BLOCK)
        idx = (row * tl.num_programs(1) + seg) * tl.num_programs(2) + c
        tl.store(pv_ptr + idx, best)
        tl.store(pi_ptr + idx, best_i)
    else:
        _, best_i = _first_max(base, 0, L, mask_col, drop, MASK, BLOCK)
        tl.store(out_ptr + row * stride_out + col0 + seg, best_i)


@triton.jit
def _argmax_merge_kernel(pv_ptr, pi_ptr, n_chunks, out_ptr, stride_out, col0,
                         NC: tl.constexpr, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    base = (row * tl.num_programs(1) + seg) * n_chunks
    c = tl.arange(0, NC)
    v = tl.load(pv_ptr + base + c, mask=c < n_chunks, other=float("-inf"))
    j = tl.argmax(v, axis=0)                    # the first chunk holding the maximum
    tl.store(out_ptr + row * stride_out + col0 + seg, tl.load(pi_ptr + base + j))


def masked_argmax(x: torch.Tensor, out: torch.Tensor, col0: int, segments: int = 1,
                  mask_col: int | None = None, phase: torch.Tensor | None = None,
                  first: torch.Tensor | None = None, block: int = 4096,
                  mask_phase: int = 0, pdl: bool = False,
                  chunk: int | None = None) -> torch.Tensor:
    """x [b, segments * L] -> out[:b, col0 : col0 + segments] (int64, row stride free).
    chunk: logits per program of the two-launch form (None: CHUNK where L >= SPLIT_MIN,
    else one program per row and segment)."""
    b, n = x.shape
    assert x.stride(1) == 1 and n % segments == 0 and out.dtype == torch.int64
    length = n // segments
    masked = mask_col is not None
    if chunk is None and length >= SPLIT_MIN:
        chunk = CHUNK
    block = min(block, triton.next_power_of_2(min(length, chunk or length)))
    _, gdc, launch_kw = pdl_launch(pdl, x)
    common = dict(MASK=masked, BLOCK=block, MASK_PHASE=mask_phase, GDC=gdc,
                  num_warps=8 if block >= 4096 else 4, **launch_kw)
    mask_args = (mask_col if masked else -1, phase if masked else out,
                 first.view(torch.uint8) if masked else out)
    if chunk is None:
        _argmax_kernel[(b, segments)](x, x.stride(0), length, length, out, out.stride(0),
                                      col0, out, out, *mask_args, **common)
        return out
    n_chunks = triton.cdiv(length, chunk)
    pv = torch.empty(b * segments * n_chunks, device=x.device, dtype=torch.float32)
    pi = torch.empty(b * segments * n_chunks, device=x.device, dtype=torch.int64)
    _argmax_kernel[(b, segments, n_chunks)](x, x.stride(0), length, chunk, out, out.stride(0),
                                            col0, pv, pi, *mask_args, CHUNKED=True, **common)
    _argmax_merge_kernel[(b, segments)](pv, pi, n_chunks, out, out.stride(0), col0,
                                        NC=triton.next_power_of_2(n_chunks), GDC=gdc,
                                        num_warps=1, **launch_kw)
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
