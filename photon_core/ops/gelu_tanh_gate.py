"""Gated GELU of Gemma's MLP: gelu_tanh(gate) * up (tanh-approximated GELU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up
