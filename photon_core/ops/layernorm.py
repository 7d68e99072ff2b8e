"""Row normalization for decode, torch references and Triton kernels side by side.

LayerNorm: y[b] = (x[b] - mean) * rstd * weight + bias, statistics in fp32, output rounded to
y's dtype (F.layer_norm's math; x may be the fp32 residual stream).
RMSNorm:   y[b] = x[b] * rsqrt(mean(x^2) + eps) * weight (fp32 math, rounded to y's dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def layernorm_row(x, ok, offs, w_ptr, b_ptr, D, eps):
    """One row's LayerNorm in fp32: x [BLOCK] fp32 (columns where ok), statistics over the D
    valid columns -> (x - mean) * rstd * weight + bias (fp32)."""
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(ok, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return xc * rstd * w + b


@triton.jit
def rmsnorm_row(x, ok, offs, w_ptr, D, eps):
    """One row's RMSNorm in fp32: x [BLOCK] fp32 (zero where not ok) -> x * rstd * weight."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return x * rstd * w


@triton.jit
def _layernorm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, D, stride_x, stride_y, eps,
                      BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    y = layernorm_row(x, ok, offs, w_ptr, b_ptr, D, eps)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                    GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    y = rmsnorm_row(x, ok, offs, w_ptr, D, eps)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
             eps: float = 1e-6, pdl: bool = False) -> torch.Tensor:
    """Triton RMSNorm of x [b, D] rows into y [b, D] (pdl: ops/pdl.py)."""
    b, d = x.shape
    assert x.stride(1) == 1 and y.stride(1) == 1
    block = triton.next_power_of_2(d)
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _rmsnorm_kernel[(b,)](x, weight, y, d, x.stride(0), y.stride(0), eps, BLOCK=block,
                          GDC=gdc, num_warps=4 if block <= 2048 else 8, **launch_kw)
    return y


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5) -> torch.Tensor:
    """The op in torch (a LayerNorm over the last dimension)."""
    return F.layer_norm(x, weight.shape, weight, bias, eps=eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                       ) -> torch.Tensor:
    """RMSNorm in torch: fp32 statistics, the result in weight's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
            ).to(weight.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, y: torch.Tensor,
               eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    b, d = x.shape
    assert x.stride(1) == 1 and y.stride(1) == 1
    block = triton.next_power_of_2(d)
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _layernorm_kernel[(b,)](x, weight, bias, y, d, x.stride(0), y.stride(0), eps, BLOCK=block,
                            GDC=gdc, num_warps=4 if block <= 2048 else 8, **launch_kw)
    return y
