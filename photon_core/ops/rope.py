"""Partial rotary position embedding (Phi style).

Only the first rot_dim = head_dim / 2 channels of each head rotate. They are read as
rot_dim / 2 complex numbers z_i = x[i] + 1j * x[i + rot_dim/2] (real parts first, imaginary
parts second, as the checkpoint's qkv projection lays them out) and multiplied by
exp(1j * pos * theta^(-2i / rot_dim)); the remaining channels pass through.

The rotated pairs are written back INTERLEAVED: [re_0, im_0, re_1, im_1, ...], which is the
channel order the public reference implementation produces. Any fixed order gives the same
q.k products mathematically (q and k are permuted alike), but in reduced precision the
dot-product summation order changes the rounding, so we use the reference's order to be
bit-exact with it. Consequently every k stored in a KV cache (the reference path's and the
fast path's, including the encoded image prefix) is in this order, and every place that
rotates q or k (`rope` below, the Triton decode_attention kernel) must write the same order.

`rope_perms` / `rope_tables` / `rope`: the same rotation as a gather + one fused multiply-add
over full-width tables, for a batch of rows at different positions (the decode step's form).

cos/sin come from the complex exponential exp(1j * angle) in fp32 (its cos/sin can differ
from Tensor.cos()/sin() in the last bit); the product is computed in fp32 and the result
cast back to the input dtype.
"""
from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, rot_dim: int, theta: float = 10000.0):
    """positions [T] -> (cos, sin), each [T, rot_dim/2] fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32,
                                            device=positions.device) / rot_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    z = torch.polar(torch.ones_like(angles), angles)     # exp(1j * angle), complex64
    return z.real.contiguous(), z.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, head_dim] (rotated part in halves order); cos/sin [T, rot_dim/2].
    Returns the rotated tensor with the rotated part interleaved (see the module doc)."""
    half = cos.shape[-1]
    re, im, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    rotated = torch.stack([out_re, out_im], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def rope_perms(rot_dim: int, head_dim: int, device=None) -> torch.Tensor:
    """[2, head_dim] source channels for rope(): output channel c (rotated pair j = c // 2,
    written interleaved like apply_rope) is x[perm[0, c]] * C[c] + x[perm[1, c]] * S[c]:
    even c: re_j * cos_j + im_j * (-sin_j);  odd c: im_j * cos_j + re_j * sin_j
    (re_j = x[j], im_j = x[rot/2 + j]); pass-through channels: x[c] * 1 + x[c] * 0."""
    half = rot_dim // 2
    a = [c // 2 if c % 2 == 0 else half + c // 2 for c in range(rot_dim)]
    b = [half + c // 2 if c % 2 == 0 else c // 2 for c in range(rot_dim)]
    rest = list(range(rot_dim, head_dim))
    return torch.tensor([a + rest, b + rest], device=device)


def rope_tables(pos: torch.Tensor, rot_dim: int, head_dim: int, theta: float = 10000.0):
    """Full-width fp32 tables for rope(): C = [cos_0, cos_0, cos_1, cos_1, .., 1..],
    S = [-sin_0, sin_0, -sin_1, sin_1, .., 0..] ([b, 1, 1, head_dim]), built once per step
    from rope_angles."""
    cos, sin = rope_angles(pos, rot_dim, theta)               # [b, rot/2]
    b, half = cos.shape
    one = torch.ones(b, head_dim - 2 * half, device=pos.device)
    zero = torch.zeros_like(one)
    c = torch.cat([torch.stack([cos, cos], dim=-1).flatten(-2), one], dim=-1)
    s = torch.cat([torch.stack([-sin, sin], dim=-1).flatten(-2), zero], dim=-1)
    return c[:, None, None, :], s[:, None, None, :]


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """apply_rope (same output channel order: rotated pairs interleaved) in a few kernels:
    x[perm[0]]*C + x[perm[1]]*S in fp32 (rope_perms, rope_tables). Same math:
    re*cos + im*(-sin), im*cos + re*sin; the pass-through channels get x*1 + x*0."""
    xf = x.float()
    return torch.addcmul(xf.index_select(-1, perm[0]) * c, xf.index_select(-1, perm[1]),
                         s).to(x.dtype)
