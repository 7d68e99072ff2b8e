"""An encoded image's k/v into a state-cache row: dst[...] = src for tensors whose last two
dims [T, D] are contiguous in both (each (layer, k/v, head) block is T * D consecutive
elements) and whose leading dims lie at any strides (the cache row's heads sit `capacity`
positions apart, its layers `rows` rows apart; an image of a batch of frames is a slice).

torch's copy_ of such views runs its generic strided kernel (~1.3 TB/s on the H200 for
Moondream 2's 730-token prefix: 0.22 ms per task start, session 19); `kv_block_copy` is one
launch of contiguous block copies, a program per (block, piece of it). The same values (a
copy, with the cast of copy_ when the dtypes differ). Off CUDA (and under the interpreter
only where the test asks) it is torch's copy_.
"""
from __future__ import annotations

import os

import torch

from ._triton import tl, triton

BLOCK = 4096            # elements per program


def kv_block_copy_reference(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@triton.jit
def _kv_block_copy_kernel(dst_ptr, src_ptr, n1, n2, d0, d1, d2, s0, s1, s2, inner,
                          BLOCK: tl.constexpr, VEC: tl.constexpr):
    a = tl.program_id(0)
    i2 = a % n2
    i1 = (a // n2) % n1
    i0 = a // (n2 * n1)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inner
    s = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2
    d = i0.to(tl.int64) * d0 + i1.to(tl.int64) * d1 + i2.to(tl.int64) * d2
    if VEC > 1:     # every block starts on a 16-byte boundary: 16-byte loads and stores
        s = tl.multiple_of(s, VEC)
        d = tl.multiple_of(d, VEC)
    v = tl.load(src_ptr + s + offs, mask=ok)
    tl.store(dst_ptr + d + offs, v.to(dst_ptr.dtype.element_ty), mask=ok)


def _blocks(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) of t's leading dims (size-1 dims dropped, padded to 3) when its last
    two dims are contiguous; None otherwise."""
    if t.dim() < 2 or t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]):
        return None
    lead = [(n, s) for n, s in zip(t.shape[:-2], t.stride()[:-2]) if n != 1]
    if len(lead) > 3:
        return None
    lead = [(1, 0)] * (3 - len(lead)) + lead
    return [n for n, _ in lead], [s for _, s in lead]


INTERPRET_ON_CPU = False        # the CPU test's switch: run the kernel under the interpreter


def kernel_runs(t: torch.Tensor) -> bool:
    return (t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1") or INTERPRET_ON_CPU


def kv_block_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src (same shape); one launch when both have contiguous [T, D] blocks."""
    if dst.shape != src.shape:
        raise ValueError(f"kv_block_copy: shapes differ, {tuple(dst.shape)} vs "
                         f"{tuple(src.shape)}")
    bd, bs = _blocks(dst), _blocks(src)
    if not kernel_runs(dst) or bd is None or bs is None or bd[0] != bs[0] or dst.numel() == 0:
        kv_block_copy_reference(dst, src)
        return
    (n0, n1, n2), (d0, d1, d2) = bd
    s0, s1, s2 = bs[1]
    inner = dst.shape[-2] * dst.shape[-1]
    grid = (n0 * n1 * n2, triton.cdiv(inner, BLOCK))
    _kv_block_copy_kernel[grid](dst, src, n1, n2, d0, d1, d2, s0, s1, s2, inner,
                                BLOCK=BLOCK, VEC=_vector(dst, src, inner, d0, d1, d2, s0, s1, s2),
                                num_warps=4)


def _vector(dst, src, *counts) -> int:
    """Elements per 16 bytes when every block of both tensors starts 16-byte aligned (the
    kernel's alignment hint), else 1."""
    vec = max(1, 16 // max(dst.element_size(), src.element_size()))
    ok = (dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0
          and all(c % vec == 0 for c in counts))
    return vec if ok else 1
