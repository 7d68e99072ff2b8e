"""Partial rotary position embedding (Phi style).

Only the first rot_dim = head_dim / 2 channels of each head rotate. They are read as
rot_dim / 2 complex numbers z_i = x[i] + 1j * x[i + rot_dim/2] and multiplied by
exp(1j * pos * theta^(-2i / rot_dim)); the remaining channels pass through. The rotated pairs
are written back in the same (first half = real, second half = imaginary) order. Any fixed
channel order gives the same q.k products, because q and k are permuted alike.
The angles are computed in fp32 and the result cast back to the input dtype.
"""
from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, rot_dim: int, theta: float = 10000.0):
    """positions [T] -> (cos, sin), each [T, rot_dim/2] fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32,
                                            device=positions.device) / rot_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, head_dim]; cos/sin [T, rot_dim/2]."""
    half = cos.shape[-1]
    re, im, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    return torch.cat([out_re.to(x.dtype), out_im.to(x.dtype), rest], dim=-1)
