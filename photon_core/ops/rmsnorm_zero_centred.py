"""Zero-centred RMSNorm (Qwen 3.5): y = x / rms(x) * (1 + w), computed in fp32.

The weight is stored centred on zero (a freshly initialised norm has w = 0, i.e. identity
scale). The product is taken in fp32 and only then cast back to the input dtype.
"""
from __future__ import annotations

import torch


def rmsnorm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rmsnorm_zero_centred(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step: s = x + delta (in x's dtype) -> (s, rmsnorm_zero_centred(s))."""
    s = x + delta
    return s, rmsnorm_zero_centred(s, weight, eps)


# -- Triton: one program per row, optionally fused with the residual add ------------------------
# grid (rows,): load the row (and the residual delta), add in fp32 and round to the input dtype
# (as `x + delta` does), write the sum back, then normalise in fp32 and scale by (1 + w).
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

    @triton.jit
    def _rmsnorm_zc_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, D, sx, sd, ss, sy, eps,
                           HAS_DELTA: tl.constexpr, BD: tl.constexpr,
                           GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        row = tl.program_id(0)
        i = tl.arange(0, BD)
        m = i < D
        x = tl.load(x_ptr + row * sx + i, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * sd + i, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * ss + i, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + i, (xf * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm_zero_centred_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                                delta: torch.Tensor | None = None):
    """delta None: same as rmsnorm_zero_centred(x, weight, eps). Else the fused residual step,
    same as add_rmsnorm_zero_centred(x, delta, weight, eps) -> (x + delta, norm)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({d},)")
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    bd = triton.next_power_of_2(d)
    if delta is None:
        _rmsnorm_zc_kernel[(x2.shape[0],)](x2, x2, weight, y, y, d, x2.stride(0), 0, 0,
                                           y.stride(0), eps, HAS_DELTA=False, BD=bd)
        return y.reshape(x.shape)
    if delta.shape != x.shape:
        raise ValueError(f"delta shape {tuple(delta.shape)} != x shape {tuple(x.shape)}")
    d2 = _rows(delta)
    s = torch.empty_like(y)
    _rmsnorm_zc_kernel[(x2.shape[0],)](x2, d2, weight, s, y, d, x2.stride(0), d2.stride(0),
                                       s.stride(0), y.stride(0), eps, HAS_DELTA=True, BD=bd)
    return s.reshape(x.shape), y.reshape(x.shape)


# -- Triton: a decode bucket's rows, strided, optionally with the residual add into x -----------
# grid (b,): row r of x (the runtime's residual stream, any row stride: fp32 in the fused
# backend), plus delta (when given: x += delta in x's dtype, stored back in place), normalised
# in fp32, scaled by (1 + w) and stored into out's row (any row stride, out's dtype: a view of
# the backend's buffer).
def rmsnorm_zero_centred_rows_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                                     eps: float = 1e-6, delta: torch.Tensor | None = None,
                                     pdl: bool = False) -> torch.Tensor:
    """x [b, D] (unit last stride, any row stride), out [b, D] (likewise; any float dtype):
    out = rmsnorm_zero_centred(x) rounded to out's dtype. With delta [b, D]: first x += delta
    in place (rounded to x's dtype, as add_rmsnorm_zero_centred), then the norm of the sum.
    pdl: programmatic dependent launch (ops/pdl.py)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, d = x.shape
    if weight.shape != (d,) or out.shape != (b, d) or (delta is not None and delta.shape != (b, d)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, out "
                         f"{tuple(out.shape)} do not fit")
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out need a unit last stride")
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    # the one-sequence kernel with the sum stored back into x (s = x)
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _rmsnorm_zc_kernel[(b,)](
        x, delta if delta is not None else x, weight.contiguous(), x, out, d, x.stride(0),
        delta.stride(0) if delta is not None else 0, x.stride(0), out.stride(0), eps,
        HAS_DELTA=delta is not None, BD=triton.next_power_of_2(d), GDC=gdc, **launch_kw)
    return out
