"""Gemma RMSNorm: x * (mean(x^2) + eps)^-0.5, times w when a weight is given (Gemma 4
multiplies by w, not 1 + w; the scale-free form normalizes v and the vision soft tokens).
Computed in fp32, returned in x's dtype (as transformers' Gemma4RMSNorm)."""
from __future__ import annotations

import torch


def rmsnorm_scaled(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
