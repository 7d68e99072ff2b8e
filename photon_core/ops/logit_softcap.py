"""Final logit soft-capping: cap * tanh(logits / cap) (Gemma's final_logit_softcapping)."""
from __future__ import annotations

import torch


def logit_softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
