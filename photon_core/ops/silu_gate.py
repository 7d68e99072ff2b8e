"""Gated SiLU of a SwiGLU MLP (Qwen 3.5, Llama-style): silu(gate) * up, computed in fp32 and
rounded once to the output's dtype (torch rounds after the SiLU too; equal in fp32).

`silu_gate` is the torch reference (the step program's act_mul "silu"); `silu_gate_triton(gate,
up, out=None)` its Triton kernel over tiles of rows (any row strides, unit column stride: the
segments of a step program's buffers); diff-tested under TRITON_INTERPRET=1 in fp32/fp16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@triton.jit
def _silu_gate_kernel(g_ptr, u_ptr, o_ptr, rows, n, stride_g, stride_u, stride_o,
                      BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (r < rows) & (c < n)
    g = tl.load(g_ptr + r * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + r * stride_o + c, y.to(o_ptr.dtype.element_ty), mask=m)


def silu_gate_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                     block: int = 1024) -> torch.Tensor:
    """gate, up [rows, n] (unit column stride) -> out [rows, n] (may alias gate or up).
    Tiles of up to 16 rows x `block` columns."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal "
                         "[rows, n] with unit column stride")
    out = torch.empty_like(gate) if out is None else out
    if out.shape != gate.shape or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(gate.shape)} with unit column stride")
    rows, n = gate.shape
    block_r = min(16, triton.next_power_of_2(rows))
    block = max(16, min(block, triton.next_power_of_2(n)) // block_r)
    _silu_gate_kernel[(triton.cdiv(rows, block_r), triton.cdiv(n, block))](
        gate, up, out, rows, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK_R=block_r,
        BLOCK=block)
    return out
