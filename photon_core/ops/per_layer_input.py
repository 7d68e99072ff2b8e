"""Per-layer inputs (Gemma 4's per-layer embeddings, PLE): for each of L layers a P-wide
input made from the row's input embedding x and its token's per-layer part:

    ple = (RMSNorm_P(x W^T * dim^-0.5) * w_norm + tok) * 2^-0.5      [n, L * P]

W [L * P, dim] (per_layer_model_projection), w_norm [P] (one norm for every layer's P
channels), tok [n, L * P] (embed_tokens_per_layer[id] * sqrt(P): the step program's
feedback). `per_layer_input` is the torch reference (models/gemma4/text.py's formula); the
fused backend runs its projection as a GEMV, then `per_layer_input_tail` on the result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rmsnorm_scaled import rmsnorm_scaled


def per_layer_input_tail(proj: torch.Tensor, tok: torch.Tensor, w_norm: torch.Tensor,
                         layers: int, width: int, dim: int, eps: float) -> torch.Tensor:
    """proj = x W^T [n, L * P] -> the per-layer inputs [n, L * P] (in proj's dtype)."""
    ctx = rmsnorm_scaled((proj * dim ** -0.5).view(-1, layers, width), w_norm, eps)
    return ((ctx + tok.view(-1, layers, width)) * 2.0 ** -0.5).view(-1, layers * width)


def per_layer_input(x: torch.Tensor, tok: torch.Tensor, w_proj: torch.Tensor,
                    w_norm: torch.Tensor, layers: int, width: int, eps: float) -> torch.Tensor:
    """x [n, dim], tok [n, L * P] -> [n, L * P]."""
    return per_layer_input_tail(F.linear(x, w_proj), tok, w_norm, layers, width, x.shape[-1],
                                eps)
