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


# -- Triton ---------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None


def rmsnorm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    """Same contract as rmsnorm_gated: x, z [..., Dv], weight [Dv] -> [..., Dv] in x's dtype.
    The rows kernel below over [rows, groups * Dv] views of x and z (x [T, H, Dv] and a column
    view z of the joined in-projection's output: no copies); inputs whose groups do not lie
    at a unit stride are copied first."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    d = x.shape[-1]
    if z.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"shapes x {tuple(x.shape)}, z {tuple(z.shape)}, weight "
                         f"{tuple(weight.shape)} do not fit")
    width = d * x.shape[-2] if x.dim() >= 3 else d      # a row: one token's value heads
    x2, z2 = (_rows_view(t, width) for t in (x, z))
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    return rmsnorm_gated_rows_triton(x2, z2, weight, out, eps).reshape(x.shape)


def _rows_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with a unit last stride: a view where its strides allow, else a
    copy."""
    try:
        v = t.view(-1, width)
    except RuntimeError:
        v = t.contiguous().view(-1, width)
    return v if v.stride(-1) == 1 else v.contiguous()


# -- Triton: a decode bucket's rows of per-head groups, strided ---------------------------------
# grid (b, H): group h (size D) of row r of o and z (views of the backend's buffer, any row
# stride) -> the same group of out's row; the reference's roundings (normalise in fp32 ->
# input dtype, times w -> input dtype, times SiLU(z) in fp32 -> input dtype).
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
