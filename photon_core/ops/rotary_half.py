"""Rotary position embedding in the rotate-half layout (pairs (i, i + D/2)), with
proportional RoPE: only the first `rotary_fraction` of the D/2 frequencies turn, the rest are
0 (cos 1, sin 0: those channels pass unchanged), all divided by `factor`."""
from __future__ import annotations

import torch


def inv_freq(head_dim: int, theta: float, rotary_fraction: float = 1.0,
             factor: float = 1.0) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies."""
    n_rot = int(rotary_fraction * head_dim // 2)
    f = 1.0 / (theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float32) / head_dim))
    f = torch.cat([f, torch.zeros(head_dim // 2 - n_rot)])
    return f / factor


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """positions [S] -> cos, sin [S, D] (the D/2 angles repeated twice), in `dtype`."""
    ang = positions.float()[:, None] * freqs.to(positions.device)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, heads, D] with cos/sin [S, D] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
