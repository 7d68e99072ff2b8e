"""Causal grouped-query attention of new tokens over a k/v cache (reference).

q [Hq, T, D] are the T newest positions start .. start+T-1; k, v [Hkv, S, D] hold positions
0 .. S-1 with S = start + T (the new ones included). Each of the Hkv k/v heads serves Hq/Hkv
consecutive query heads. Softmax in fp32; scale D^-0.5.
"""
from __future__ import annotations

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    scores = (q.float() @ k.float().transpose(-1, -2)) * d ** -0.5          # [Hq, T, S]
    qpos = torch.arange(start, start + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)                      # [Hq, T, D]
