"""Depthwise causal 1D convolution with SiLU, as a prefill over a sequence and a one-token step.

Each channel c has its own K-tap filter w[c, :]; output t sees inputs t-K+1 .. t. The layer
keeps the last K-1 inputs as its state, so a sequence can be continued token by token (or by
another prefill) exactly as if it had been processed in one piece.
  x      [B, C, T]      inputs (channels first)
  state  [B, C, K-1]    the K-1 inputs before x (zeros at the start of a sequence)
  weight [C, K]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (SiLU(conv(x)) [B, C, T], new state [B, C, K-1]). state None = zeros."""
    b, c, t = x.shape
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(b, c, k - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)             # [B, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=c)   # [B, C, T]
    return F.silu(out).to(x.dtype), full[:, :, -(k - 1):].clone()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token: x [B, C] -> SiLU(conv) [B, C]; state [B, C, K-1] is updated in place."""
    window = torch.cat([state, x.unsqueeze(-1).to(state.dtype)], dim=-1)   # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    state.copy_(window[:, :, 1:])
    return F.silu(out).to(x.dtype)
