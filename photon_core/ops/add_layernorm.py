"""Residual add + LayerNorm in one pass over the rows (the big-M form: the vision tower's
pre-LN blocks, x += t; h = LayerNorm(x)), torch reference and Triton kernel side by side.

Reference: s = x + t (rounded to x's dtype, as torch's add), h = F.layer_norm(s) (fp32
statistics, rounded to the dtype). The kernel reads x and t once and writes s and h: the
separate form reads s again for the norm (one pass of [rows, D] less per block; 54 in the
vision tower of a 640x480 encode, ~15 MB each). s is bitwise the reference's (an fp32 add
rounded once); h's statistics are summed in another order: close, not always bitwise.
With t_bias (a bias vector of the D columns, the image prefill's fc2 bias): s = x + t +
t_bias in fp32, rounded once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .layernorm import layernorm_row


@triton.jit
def _add_layernorm_kernel(x_ptr, t_ptr, w_ptr, b_ptr, s_ptr, h_ptr, D, eps, tb_ptr,
                          BLOCK: tl.constexpr, HAS_TB: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    st = x + t
    if HAS_TB:
        st = st + tl.load(tb_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = st.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * D + offs, s, mask=ok)
    h = layernorm_row(s.to(tl.float32), ok, offs, w_ptr, b_ptr, D, eps)
    tl.store(h_ptr + row * D + offs, h.to(h_ptr.dtype.element_ty), mask=ok)


def add_layernorm_reference(x: torch.Tensor, t: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor, eps: float = 1e-5,
                            t_bias: torch.Tensor | None = None):
    if t_bias is None:
        s = x + t
    else:                   # x + t + t_bias in fp32, rounded once (the kernel's math)
        s = (x.float() + t.float() + t_bias.float()).to(x.dtype)
    return s, F.layer_norm(s, weight.shape, weight, bias, eps=eps)


def add_layernorm(x: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float = 1e-5, t_bias: torch.Tensor | None = None):
    """x, t [..., D] contiguous, same shape and dtype -> (s = x + t, LayerNorm(s)).
    t_bias [D] (optional): s = x + t + t_bias, summed in fp32 and rounded once (the image
    prefill's Phi block: x + (a Wproj^T + b_proj + g Wfc2^T) + b_fc2, the last GEMM's bias
    folded in here, prefix_prefill.py)."""
    if x.shape != t.shape or x.dtype != t.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and t {tuple(t.shape)} {t.dtype} differ")
    x, t = x.contiguous(), t.contiguous()
    d = x.shape[-1]
    s, h = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        block = triton.next_power_of_2(d)
        _add_layernorm_kernel[(rows,)](x, t, weight, bias, s, h, d, eps,
                                       x if t_bias is None else t_bias, BLOCK=block,
                                       HAS_TB=t_bias is not None,
                                       num_warps=4 if block <= 2048 else 8)
    return s, h


__all__ = ["add_layernorm", "add_layernorm_reference"]
