"""The Phi-style text decoder.

Every block is "parallel": one LayerNorm feeds both branches, h = x + attn(ln(x)) + mlp(ln(x)).
Attention uses a fused qkv projection (with bias), partial rotary embeddings and the cache.

Mask: position i may attend to j when j <= i (causal), or when both lie in the image prefix
(i, j < prefix_len = 730: BOS + 729 image tokens see each other bidirectionally).

Attention extent: like the public reference implementation, every attention call (the image
prefix, a prompt prefill, a single decode step) runs scaled_dot_product_attention over the
WHOLE context span (max_context key positions) with a boolean mask, not over the positions
in use. The masked keys contribute exact zeros, so the math is the same, but the CPU SDPA
kernel blocks its work by the key length, so in bf16 the rounding (and occasionally a greedy
pick) depends on it; using the same extent and mask shapes keeps us bit-exact with the
reference. A cache whose storage is shorter than the span (the image-prefix cache, a fast-path
row) is read zero-padded to the span.

The blocks are the ops of program.decoder_ops (the one description of a block, which the
runtime's backends run too), interpreted with the ops' torch references (ops/eager.py) in
this order: h = LayerNorm(x); qkv = Linear(h); g = gelu_tanh(Linear_fc1(h)); a = attention;
x = x + Linear_proj(a) + Linear_fc2(g).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.eager import run_ops
from .config import TextConfig
from .kv_cache import KVCache
from .layers import Weights
from .program import decoder_ops
from .rope import apply_rope, rope_angles


def attention_mask(start: int, length: int, prefix_len: int, device,
                   span: int | None = None) -> torch.Tensor:
    """Boolean [length, span] mask for queries at start..start+length-1 over key positions
    [0, span) (default span: start + length)."""
    span = start + length if span is None else span
    q = torch.arange(start, start + length, device=device)[:, None]
    k = torch.arange(span, device=device)[None, :]
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
    span = cfg.max_context
    mask = attention_mask(start, length, prefix_len, x.device, span)
    # the shapes the reference passes to SDPA: [1, 1, span] (one decode step), else [1, 1, T, span]
    mask = mask[None] if length == 1 else mask[None, None]

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(q.view(1, length, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(1, length, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(1, length, nkv, hd).transpose(1, 2)
        k, v = cache.write(i, start, k, v, span)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nh != nkv)
        return a.transpose(1, 2).reshape(1, length, dim)

    x = run_ops(decoder_ops(cfg), {"x": x}, w, attend)["x"]
    cache.length = max(cache.length, start + length)
    return x


def lm_head(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Hidden state(s) [..., dim] -> logits [..., vocab] (final LayerNorm, then linear)."""
    return w.linear(w.layer_norm(hidden, "text.post_ln"), "text.lm_head")
