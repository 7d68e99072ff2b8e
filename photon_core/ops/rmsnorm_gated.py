"""Gated RMSNorm (the output norm of a Gated DeltaNet layer): y = w * x / rms(x) * SiLU(z).

Per head (the last dimension is one head's value width). The weight is a plain scale (NOT
zero-centred). Order of roundings as the reference: normalise in fp32, cast to the input
dtype, multiply by w, multiply by SiLU(z) in fp32, cast back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                  eps: float = 1e-6) -> torch.Tensor:
    """x, z [..., Dv], weight [Dv] -> [..., Dv] in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight * y
    return (y * F.silu(z.float())).to(dtype)


# -- Triton: one program per row (one head's Dv values) ----------------------------------------
# Same roundings as the reference: normalise in fp32 -> input dtype, times w -> input dtype,
# times SiLU(z) in fp32 -> input dtype.
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    @triton.jit
    def _rmsnorm_gated_kernel(x_ptr, z_ptr, w_ptr, y_ptr, D, sx, sz, sy, eps,
                              BD: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, BD)
        m = i < D
        x = tl.load(x_ptr + row * sx + i, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        dt = y_ptr.dtype.element_ty
        y = (x * rstd).to(dt).to(tl.float32)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        y = (w * y).to(dt).to(tl.float32)
        z = tl.load(z_ptr + row * sz + i, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + i, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=m)


def rmsnorm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    """Same contract as rmsnorm_gated: x, z [..., Dv], weight [Dv] -> [..., Dv] in x's dtype."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    d = x.shape[-1]
    if z.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"shapes x {tuple(x.shape)}, z {tuple(z.shape)}, weight "
                         f"{tuple(weight.shape)} do not fit")
    x2, z2 = (t.reshape(-1, d) for t in (x, z))
    x2, z2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, z2))
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rmsnorm_gated_kernel[(x2.shape[0],)](x2, z2, weight, y, d, x2.stride(0), z2.stride(0),
                                          y.stride(0), eps, BD=triton.next_power_of_2(d))
    return y.reshape(x.shape)


# -- Triton: a decode bucket's rows of per-head groups, strided ---------------------------------
# grid (b, H): group h (size D) of row r of o and z (views of the backend's buffer, any row
# stride) -> the same group of out's row; the reference's roundings.
if triton is not None:
    @triton.jit
    def _rmsnorm_gated_rows_kernel(x_ptr, z_ptr, w_ptr, y_ptr, D, sx, sz, sy, eps,
                                   BD: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * D
        i = tl.arange(0, BD)
        m = i < D
        x = tl.load(x_ptr + row * sx + col + i, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        dt = y_ptr.dtype.element_ty
        y = (x * rstd).to(dt).to(tl.float32)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        y = (w * y).to(dt).to(tl.float32)
        z = tl.load(z_ptr + row * sz + col + i, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + col + i, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=m)


def rmsnorm_gated_rows_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                              out: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x, z, out [b, H * Dv] (unit last stride, any row stride), weight [Dv]: each row's H
    groups of Dv channels (one value head each) -> out = rmsnorm_gated per group, in x's
    dtype (out's dtype must be x's)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    d = weight.shape[0]
    b, n = x.shape
    if weight.dim() != 1 or n % d or z.shape != x.shape or out.shape != x.shape or \
            out.dtype != x.dtype:
        raise ValueError(f"shapes x {tuple(x.shape)}, z {tuple(z.shape)}, out "
                         f"{tuple(out.shape)}, weight {tuple(weight.shape)} do not fit")
    if any(t.stride(-1) != 1 for t in (x, z, out)):
        raise ValueError("x, z and out need a unit last stride")
    _rmsnorm_gated_rows_kernel[(b, n // d)](x, z, weight.contiguous(), out, d, x.stride(0),
                                            z.stride(0), out.stride(0), eps,
                                            BD=triton.next_power_of_2(d))
    return out
