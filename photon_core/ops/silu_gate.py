"""Gated SiLU of a SwiGLU MLP (Qwen 3.5, Llama-style): silu(gate) * up, computed in fp32 and
rounded once to the output's dtype (torch rounds after the SiLU too; equal in fp32).

`silu_gate` is the torch reference (the step program's act_mul "silu"); `silu_gate_triton(gate,
up, out=None)` its Triton kernel over tiles of rows (any row strides, unit column stride: the
segments of a step program's buffers); diff-tested under TRITON_INTERPRET=1 in fp32/fp16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gated_activation import gated_activation_triton


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_gate_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None,
                     block: int = 1024) -> torch.Tensor:
    """gate, up [rows, n] (unit column stride) -> out [rows, n] (may alias gate or up).
    Tiles of up to 16 rows x `block` columns (ops/gated_activation.py)."""
    return gated_activation_triton(gate, up, "silu", out=out, block=block)
