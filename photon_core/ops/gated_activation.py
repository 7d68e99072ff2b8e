"""act(gate) * up over tiles of rows, fp32 math, rounded once to the output's dtype: the one
Triton kernel behind the gated MLP activations (ops/gelu_tanh_gate.py: Gemma's tanh GELU,
ops/silu_gate.py: SwiGLU's SiLU). Any row strides, unit column stride (the segments of a step
program's buffers); out may alias gate or up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton

ACTIVATIONS = ("gelu_tanh", "silu")
ACT_GELU_TANH, ACT_SILU = 0, 1       # the kernels' constexpr codes (ops/gemv.py's epilogues)


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow anywhere
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def gated_value(g, u, GELU: tl.constexpr):
    """act(g) * u in fp32 (g, u fp32): the one formula of every kernel that applies a gated
    activation (this file's, ops/gemv.py's EPI_GATED / EPI_ACT_MUL epilogues), so they agree
    bit for bit."""
    if GELU:
        # sqrt(2 / pi) written out: a compiled kernel reads no non-constexpr global
        y = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u
    else:
        y = g / (1.0 + tl.exp(-g)) * u
    return y


@triton.jit
def _gated_act_kernel(g_ptr, u_ptr, o_ptr, rows, n, stride_g, stride_u, stride_o,
                      BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (r < rows) & (c < n)
    g = tl.load(g_ptr + r * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
    y = gated_value(g, u, GELU)
    tl.store(o_ptr + r * stride_o + c, y.to(o_ptr.dtype.element_ty), mask=m)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in torch, in the inputs' dtype (pass fp32 for the kernels' math)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, not {act!r}")
    g = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
    return g * up


def gated_activation_triton(gate: torch.Tensor, up: torch.Tensor, act: str,
                            out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """gate, up [rows, n] (unit column stride) -> out [rows, n] = act(gate) * up; tiles of up
    to 16 rows x `block` columns."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, not {act!r}")
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal "
                         "[rows, n] with unit column stride")
    out = torch.empty_like(gate) if out is None else out
    if out.shape != gate.shape or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(gate.shape)} with unit column stride")
    rows, n = gate.shape
    block_r = min(16, triton.next_power_of_2(rows))
    block = max(16, min(block, triton.next_power_of_2(n)) // block_r)
    _gated_act_kernel[(triton.cdiv(rows, block_r), triton.cdiv(n, block))](
        gate, up, out, rows, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK_R=block_r,
        BLOCK=block, GELU=act == "gelu_tanh")
    return out
