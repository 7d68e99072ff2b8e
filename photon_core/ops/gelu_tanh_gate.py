"""Gated GELU of Gemma's MLP and per-layer-input gate: gelu_tanh(gate) * up (tanh-approximated
GELU), rounded once to the inputs' dtype (torch rounds after the GELU too; equal in fp32).

`gelu_tanh_gate` is the torch reference; `gelu_tanh_gate_triton(gate, up, out=None)` its
Triton kernel over tiles of rows (any row strides, unit column stride: the segments of a step
program's buffers), fp32 math; diff-tested under TRITON_INTERPRET=1 in fp32/fp16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gated_activation import gated_activation_triton


def gelu_tanh_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_gate_triton(gate: torch.Tensor, up: torch.Tensor,
                          out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """gate, up [rows, n] (unit column stride) -> out [rows, n] (may alias gate or up).
    Tiles of up to 16 rows x `block` columns (ops/gated_activation.py)."""
    return gated_activation_triton(gate, up, "gelu_tanh", out=out, block=block)
