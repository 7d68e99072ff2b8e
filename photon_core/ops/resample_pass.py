"""One separable pass of PIL's 8-bit resize (pil_resize.py: LANCZOS / BICUBIC, the fixed-point
filter of Pillow's Resample.c) along one axis of a uint8 [H, W, C] image; torch reference and
Triton kernel side by side.

    y = resample_pass(x, dim, index, weights)

index [out * ksize] int64: the input position of each output's taps (clamped into the image;
a clamped tap weighs 0), weights [out, ksize] int32 (round(w * 2^22)), as
pil_resize._device_tables makes them. An output is clamp((2^21 + sum(pixel * weight)) >> 22,
0, 255) in int32 - integer arithmetic, so the kernel and the reference give the same bytes
(wrapping alike even on an overflow, which pil_resize's doc shows cannot happen).

The reference gathers the taps (index_select), multiplies by the weights, sums, shifts and
clamps: ~7 launches and an int32 [*, out, ksize, *] intermediate per pass (a 640x480 frame's
4 passes in Moondream 2's crops: ~0.35 ms on the H200). The kernel: one launch per pass, each
program a block of output bytes, its taps loaded and summed in registers.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

PRECISION_BITS = 22     # pil_resize.PRECISION_BITS


@triton.jit
def _resample_pass_kernel(x_ptr, idx_ptr, w_ptr, y_ptr, total, IN, OUT, INNER,
                          KSIZE: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr):
    """x viewed as [outer, IN, INNER] -> y [outer, OUT, INNER]; one block of y's bytes
    (int32 offsets: the wrapper checks that both images have fewer than 2^31 bytes)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    inner = offs % INNER
    t = offs // INNER
    o = t % OUT
    base = (t // OUT) * IN * INNER + inner
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(KSIZE):
        src = tl.load(idx_ptr + o * KSIZE + k, mask=ok, other=0)
        wk = tl.load(w_ptr + o * KSIZE + k, mask=ok, other=0)
        px = tl.load(x_ptr + base + src * INNER, mask=ok, other=0)
        acc += px.to(tl.int32) * wk
    acc = (acc + (1 << (PREC - 1))) >> PREC
    acc = tl.minimum(tl.maximum(acc, 0), 255)
    tl.store(y_ptr + offs, acc.to(tl.uint8), mask=ok)


def resample_pass_reference(x: torch.Tensor, dim: int, index: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
    """The output positions whose taps are `index` [n * ksize] with `weights` [n, ksize],
    along dim of the uint8 image x, by torch ops."""
    n, ksize = weights.shape
    taps = x.index_select(dim, index)               # uint8, the tap axis right after dim
    shape = list(x.shape)
    shape[dim:dim + 1] = [n, ksize]
    w_shape = [1] * len(shape)
    w_shape[dim:dim + 2] = [n, ksize]
    # uint8 * int32 promotes to int32 inside the one kernel
    acc = (taps.view(shape) * weights.view(w_shape)).sum(dim=dim + 1, dtype=torch.int32)
    acc += 1 << (PRECISION_BITS - 1)
    return (acc >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def resample_pass(x: torch.Tensor, dim: int, index: torch.Tensor, weights: torch.Tensor,
                  block: int = 1024) -> torch.Tensor:
    """resample_pass_reference as one Triton launch (CUDA, or the CPU under
    TRITON_INTERPRET=1): the same bytes."""
    if x.dtype != torch.uint8:
        raise ValueError(f"expected a uint8 image, got {x.dtype}")
    n, ksize = weights.shape
    if index.numel() != n * ksize:
        raise ValueError(f"index has {index.numel()} taps, weights {n} x {ksize}")
    x = x.contiguous()
    shape = list(x.shape)
    inner = 1
    for s in shape[dim + 1:]:
        inner *= s
    shape[dim] = n
    y = torch.empty(shape, dtype=torch.uint8, device=x.device)
    total = y.numel()
    if max(total, x.numel()) >= 2 ** 31:
        raise ValueError(f"images of 2^31 bytes or more are not supported ({tuple(x.shape)} "
                         f"-> {tuple(y.shape)})")
    if total:
        _resample_pass_kernel[(triton.cdiv(total, block),)](
            x, index.contiguous(), weights.contiguous(), y, total, x.shape[dim], n, inner,
            KSIZE=ksize, PREC=PRECISION_BITS, BLOCK=block, num_warps=4)
    return y


__all__ = ["resample_pass", "resample_pass_reference", "PRECISION_BITS"]
