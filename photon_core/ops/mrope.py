"""Interleaved multimodal rotary embedding (M-RoPE, Qwen 3.5) and its application.

Positions come in three rows (temporal, height, width); text tokens have three equal rows,
image tokens (t0, t0 + row, t0 + col). Of the F = rot_dim/2 frequencies, frequency i takes its
angle from row 1 (height) when i % 3 == 1 and i < 3*sections[1], from row 2 (width) when
i % 3 == 2 and i < 3*sections[2], else from row 0. The rotation is rotate-half style over the
first rot_dim dims of each head (partial rotary); the rest pass through.
"""
from __future__ import annotations

import torch


def inv_freq(rot_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))


def mrope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float, sections,
                  dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] (int) -> cos, sin [T, rot_dim] in dtype."""
    freqs = positions.float()[..., None] * inv_freq(rot_dim, theta, positions.device)  # [3, T, F]
    sel = freqs[0].clone()
    for row in (1, 2):
        idx = slice(row, sections[row] * 3, 3)
        sel[..., idx] = freqs[row][..., idx]
    emb = torch.cat([sel, sel], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] (heads before T), cos/sin [T, R] with R <= D: rotate the first R dims."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)
