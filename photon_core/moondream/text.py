"""The Phi-style text decoder.

Every block is "parallel": one LayerNorm feeds both branches, h = x + attn(ln(x)) + mlp(ln(x)).
Attention uses a fused qkv projection (with bias), partial rotary embeddings and the cache.

Mask: position i may attend to j when j <= i (causal), or when both lie in the image prefix
(i, j < prefix_len = 730: BOS + 729 image tokens see each other bidirectionally).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import TextConfig
from .kv_cache import KVCache
from .layers import Weights
from .rope import apply_rope, rope_angles


def attention_mask(start: int, length: int, prefix_len: int, device) -> torch.Tensor | None:
    """Boolean [length, start+length] mask for queries at start..start+length-1, or None when
    every query may see every key (a single decode step, or a block inside the prefix)."""
    end = start + length
    if end <= prefix_len or length == 1:
        return None
    q = torch.arange(start, end, device=device)[:, None]
    k = torch.arange(end, device=device)[None, :]
    return (k <= q) | ((q < prefix_len) & (k < prefix_len))


def embed(w: Weights, token_ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(token_ids, w["text.wte"])


def decoder(w: Weights, cfg: TextConfig, x: torch.Tensor, start: int, cache: KVCache,
            prefix_len: int) -> torch.Tensor:
    """Run embeddings x [1, T, dim] at positions start..start+T-1 through all blocks, writing
    their k/v into the cache; returns the last hidden states [1, T, dim] (before post_ln)."""
    _, length, dim = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    positions = torch.arange(start, start + length, device=x.device)
    cos, sin = rope_angles(positions, cfg.rot_dim)
    mask = attention_mask(start, length, prefix_len, x.device)
    for i in range(cfg.n_layers):
        p = f"text.blocks.{i}"
        h = w.layer_norm(x, p + ".ln")
        q, k, v = w.linear(h, p + ".attn.qkv").split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(q.view(1, length, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(1, length, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(1, length, nkv, hd).transpose(1, 2)
        k, v = cache.write(i, start, k, v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != nkv)
        a = w.linear(a.transpose(1, 2).reshape(1, length, dim), p + ".attn.proj")
        x = x + a + w.mlp(h, p + ".mlp")
    cache.length = max(cache.length, start + length)
    return x


def lm_head(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Hidden state(s) [..., dim] -> logits [..., vocab] (final LayerNorm, then linear)."""
    return w.linear(w.layer_norm(hidden, "text.post_ln"), "text.lm_head")
