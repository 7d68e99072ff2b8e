"""Gated GELU of Gemma's MLP and per-layer-input gate: gelu_tanh(gate) * up (tanh-approximated
GELU), rounded once to the inputs' dtype (torch rounds after the GELU too; equal in fp32).

`gelu_tanh_gate` is the torch reference; `gelu_tanh_gate_triton(gate, up, out=None)` its
Triton kernel over tiles of rows (any row strides, unit column stride: the segments of a step
program's buffers), fp32 math; diff-tested under TRITON_INTERPRET=1 in fp32/fp16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton

SQRT_2_OVER_PI = 0.7978845608028654


def gelu_tanh_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow anywhere
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _gelu_gate_kernel(g_ptr, u_ptr, o_ptr, rows, n, stride_g, stride_u, stride_o,
                      BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (r < rows) & (c < n)
    g = tl.load(g_ptr + r * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
    # sqrt(2 / pi) written out: a compiled kernel reads no non-constexpr global
    y = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u
    tl.store(o_ptr + r * stride_o + c, y.to(o_ptr.dtype.element_ty), mask=m)


def gelu_tanh_gate_triton(gate: torch.Tensor, up: torch.Tensor,
                          out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """gate, up [rows, n] (unit column stride) -> out [rows, n] (may alias gate or up).
    Tiles of up to 16 rows x `block` columns."""
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty_like(gate) if out is None else out
    assert out.shape == gate.shape and out.stride(1) == 1
    rows, n = gate.shape
    block_r = min(16, triton.next_power_of_2(rows))
    block = max(16, min(block, triton.next_power_of_2(n)) // block_r)
    _gelu_gate_kernel[(triton.cdiv(rows, block_r), triton.cdiv(n, block))](
        gate, up, out, rows, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK_R=block_r,
        BLOCK=block)
    return out
