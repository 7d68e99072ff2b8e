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
