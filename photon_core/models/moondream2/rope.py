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
rotates q or k (photon_core/fast: decode_step.rope, the Triton decode_attention kernel,
graphed_prefill) must write the same order.

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
