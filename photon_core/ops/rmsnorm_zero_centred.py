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
