"""Gemma RMSNorm: x * (mean(x^2) + eps)^-0.5, times w when a weight is given (Gemma 4
multiplies by w, not 1 + w; the scale-free form normalizes v and the vision soft tokens).
Computed in fp32, returned in x's dtype (as transformers' Gemma4RMSNorm).

`rmsnorm_scaled` is the torch reference; `rmsnorm_scaled_triton` its Triton kernel (one
program per row, the row in one block), diff-tested in fp32/fp16 under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # pragma: no cover - the reference needs no triton
    triton = None


def rmsnorm_scaled(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + row * n + c, mask=m, other=0.0).to(tl.float32)
        y = x / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + c, y.to(y_ptr.dtype.element_ty), mask=m)


def rmsnorm_scaled_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Triton kernel of `rmsnorm_scaled` (contiguous x, any leading shape)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    x2 = x.contiguous().view(-1, x.shape[-1])
    y = torch.empty_like(x2)
    n = x2.shape[1]
    _rmsnorm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, n, float(eps),
                                    HAS_W=weight is not None, BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape)
