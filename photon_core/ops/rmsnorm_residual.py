"""Gemma's sandwich-norm residual: x = (x + RMSNorm(src) * w) * s: the post-attention /
post-feedforward / post-per-layer-input norm, the add into the residual stream, and (after a
layer's last add) the layer scalar s, in one pass over the row.

`rmsnorm_residual` is the torch reference in the reference decoder's rounding (the norm's
output and the sum rounded to x's dtype, as text.layer computes it); the Triton kernel
`rmsnorm_residual_triton` works in fp32 and writes x in place (the fused backend's fp32
residual stream), one program per row; diff-tested under TRITON_INTERPRET=1. With `next_weight`
it also writes the NEXT norm of the updated row, h = RMSNorm(x) * next_weight (the norm that
follows in a Gemma layer: pre_feedforward_layernorm, the next layer's input_layernorm), the
same math as ops/layernorm.rms_norm over the stored x: one launch instead of two.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .layernorm import rmsnorm_row
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from .rmsnorm_scaled import rmsnorm_scaled


def rmsnorm_residual(src: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, eps: float,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    y = x + rmsnorm_scaled(src, weight, eps).to(x.dtype)
    return y if scale is None else y * scale


@triton.jit
def _rmsnorm_residual_kernel(s_ptr, w_ptr, x_ptr, scale_ptr, n, stride_s, stride_x, eps,
                             w2_ptr, h_ptr, stride_h, eps2,
                             HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                             NEXT: tl.constexpr = False, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < n
    s = tl.load(s_ptr + row * stride_s + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    y = x + s / tl.sqrt(tl.sum(s * s, axis=0) / n + eps) * w
    if HAS_SCALE:
        y = y * tl.load(scale_ptr).to(tl.float32)
    y = y.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + c, y, mask=m)
    if NEXT:
        h = rmsnorm_row(y.to(tl.float32), m, c, w2_ptr, n, eps2)
        tl.store(h_ptr + row * stride_h + c, h.to(h_ptr.dtype.element_ty), mask=m)


def rmsnorm_residual_triton(src: torch.Tensor, weight: torch.Tensor, x: torch.Tensor,
                            eps: float, scale: torch.Tensor | None = None,
                            next_weight: torch.Tensor | None = None,
                            h: torch.Tensor | None = None, next_eps: float = 1e-6,
                            pdl: bool = False) -> torch.Tensor:
    """src, x [rows, n] (unit column stride); x updated in place and returned. next_weight:
    also h [rows, n] = RMSNorm(updated x) * next_weight (eps next_eps). pdl: ops/pdl.py."""
    assert src.shape == x.shape and src.stride(1) == 1 and x.stride(1) == 1
    nxt = next_weight is not None
    if nxt:
        assert h is not None and h.shape == x.shape and h.stride(1) == 1
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _rmsnorm_residual_kernel[(rows,)](src, weight, x, scale if scale is not None else weight,
                                      n, src.stride(0), x.stride(0), float(eps),
                                      next_weight if nxt else weight, h if nxt else x,
                                      h.stride(0) if nxt else 0, float(next_eps),
                                      HAS_SCALE=scale is not None, BLOCK=block, NEXT=nxt,
                                      GDC=gdc, num_warps=4 if block <= 2048 else 8, **launch_kw)
    return x
