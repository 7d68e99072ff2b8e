"""Rotary position embedding in the rotate-half layout (pairs (i, i + D/2)), with
proportional RoPE: only the first `rotary_fraction` of the D/2 frequencies turn, the rest are
0 (cos 1, sin 0: those channels pass unchanged), all divided by `factor`.

Torch reference: `inv_freq`, `cos_sin`, `apply_rotary_half`. Triton kernel, fused where
Gemma 4 uses it: `norm_rotary_triton` = per-head RMSNorm (optional weight, optional
scale-free) then the rotation (or, halves=2, the axial rotation of its vision tower,
reference `axial_rotary`) at each row's own position (cos/sin tables indexed by a
device position tensor, so it runs inside a CUDA graph), one program per row;
`rotary_half_triton` is the plain rotation. Both diff-tested under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


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


@triton.jit
def _norm_rotary_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, heads, stride_x,
                        stride_o, stride_t, w_head_stride, eps, D: tl.constexpr,
                        BLOCK_H: tl.constexpr,
                        NORM: tl.constexpr, HAS_W: tl.constexpr, ROTATE: tl.constexpr,
                        GDC: tl.constexpr = False, HALVES: tl.constexpr = 1):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    hh = tl.arange(0, BLOCK_H)[:, None]          # every head of the row in one tile
    i = tl.arange(0, D)[None, :]
    B: tl.constexpr = D // HALVES                # each rotate-half block's width
    j = (i // B) * B + (i % B + B // 2) % B      # the partner channel of the rotate-half pair
    m = (hh < heads) & (i < D)
    base = x_ptr + row * stride_x + hh * D
    x = tl.load(base + i, mask=m, other=0.0).to(tl.float32)
    xj = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = x * rstd
        xj = xj * rstd
        if HAS_W:
            wrow = w_ptr + hh * w_head_stride       # one weight per head, or one for all
            x = x * tl.load(wrow + i, mask=m, other=0.0).to(tl.float32)
            xj = xj * tl.load(wrow + j, mask=m, other=0.0).to(tl.float32)
    if ROTATE:
        p = tl.load(pos_ptr + row)
        c = tl.load(cos_ptr + p * stride_t + i).to(tl.float32)
        s = tl.load(sin_ptr + p * stride_t + i).to(tl.float32)
        x = x * c + tl.where(i % B < B // 2, -xj, xj) * s
    tl.store(o_ptr + row * stride_o + hh * D + i, x.to(o_ptr.dtype.element_ty), mask=m)


def norm_rotary_triton(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, pos: torch.Tensor | None, head_dim: int,
                       eps: float = 1e-6, norm: bool = True,
                       out: torch.Tensor | None = None, pdl: bool = False,
                       halves: int = 1) -> torch.Tensor:
    """x [rows, heads * D] (unit column stride): per head RMSNorm (times weight [D], or
    [heads * D]: a weight per head, e.g. q and k side by side with their own norms; none:
    scale-free; norm=False: no norm), then rotate-half at position pos[row] of the tables
    cos/sin [positions, D] (skipped when cos is None). -> out [rows, heads * D] (may alias
    x). One program per row (all its heads in one tile). pdl: ops/pdl.py. halves=2: each
    head's two halves rotate on their own (rotate-half over D/2 each, the tables' columns
    giving each half its angles: Gemma 4's axial vision rotary, `axial_rotary`)."""
    rows, n = x.shape
    d = head_dim
    assert n % d == 0 and x.stride(1) == 1 and d & (d - 1) == 0, "power-of-two head size"
    assert halves in (1, 2)
    out = torch.empty_like(x) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1
    rotate = cos is not None
    if rotate:
        assert cos.stride(1) == 1 and sin.stride() == cos.stride() and cos.shape[1] == d
    heads = n // d
    block_h = triton.next_power_of_2(heads)
    per_head = weight is not None and weight.numel() == n and n != d
    assert weight is None or weight.numel() in (d, n)
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _norm_rotary_kernel[(rows,)](
        x, weight if weight is not None else x, cos if rotate else x, sin if rotate else x,
        pos if rotate else x, out, heads, x.stride(0), out.stride(0),
        cos.stride(0) if rotate else 0, d if per_head else 0, float(eps), D=d,
        BLOCK_H=block_h, NORM=norm, HAS_W=weight is not None, ROTATE=rotate, GDC=gdc,
        HALVES=halves,
        num_warps=4 if block_h * d <= 4096 else 8,    # sm_90: no spills at 16 x 512 fp32
        **launch_kw)
    return out


def axial_rotary(x: torch.Tensor, cx: torch.Tensor, sx: torch.Tensor, cy: torch.Tensor,
                 sy: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]: rotate-half by column angles (cx, sx [N, D/2]) on x[..., :D/2], by row
    angles (cy, sy) on x[..., D/2:] (Gemma 4's vision; norm_rotary_triton(halves=2) with the
    tables side by side, [cx | cy] and [sx | sy], is its kernel)."""
    half = x.shape[-1] // 2
    return torch.cat([apply_rotary_half(x[..., :half], cx, sx),
                      apply_rotary_half(x[..., half:], cy, sy)], dim=-1)


def rotary_half_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Kernel of `apply_rotary_half` for x [S, heads, D] with cos/sin [S, D]."""
    s, h, d = x.shape
    x2 = x.contiguous().view(s, h * d)
    pos = torch.arange(s, device=x.device)
    return norm_rotary_triton(x2, None, cos.contiguous(), sin.contiguous(), pos, d,
                              norm=False).view(s, h, d)
