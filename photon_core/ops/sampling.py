"""Choosing the next token: greedy at temperature 0, else temperature + nucleus (top-p).

top-p keeps the smallest set of most likely tokens whose probability mass reaches top_p: a
token is dropped when the mass of the tokens strictly more likely than it already exceeds
top_p. The kept probabilities are renormalized and one token is drawn. As in the reference,
the filter runs at every temperature > 0, top_p = 1 included (float cumulative sums can pass 1
and drop the far tail), so the same global RNG state draws the same token. Unlike the
reference, softmax and filter run in float32 whatever the model dtype (it uses the logits'
dtype, bf16 for bf16 models).
"""
from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before > top_p, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None = None) -> int:
    """logits [vocab] -> token id."""
    if temperature == 0:
        return int(logits.argmax())
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
