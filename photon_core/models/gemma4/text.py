"""The Gemma 4 text decoder (reference, batch 1), written as one function per step.

Embeddings: embed_tokens[id] * sqrt(hidden) (the scale rounded to the weight dtype, as
transformers). Per-layer embeddings (PLE), for every position a [n_layers, P] input:
token part embed_tokens_per_layer[id] * sqrt(P) (image positions use the pad id), context
part RMSNorm(per_layer_model_projection(x) * hidden^-0.5); input = (context + token) * 2^-0.5.

Layer i (sandwich norms, all RMSNorms multiply by w):
  h = norm(x); q = q_norm(Wq h), rotary; unless KV-shared: k = k_norm(Wk h), rotary,
  v = scale-free norm(Wv h) (or of Wk h when keys equal values), written to the cache;
  attention with scale 1.0 over the cache of kv_source(i): causal, limited to the last
  `sliding_window` positions on sliding layers; x += post_attn_norm(Wo a)
  x += post_ffn_norm(down(gelu_tanh(gate(pre_ffn_norm(x))) * up(...)))
  PLE: x += post_ple_norm(proj(gelu_tanh(ple_gate(x)) * ple_i));  x *= layer_scalar
Sliding and global layers have their own head size and RoPE (theta 1e4 full rotation vs
proportional RoPE theta 1e6 on a quarter of the pairs). Final: norm, tied lm_head,
optional logit soft-capping.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...ops.gelu_tanh_gate import gelu_tanh_gate, gelu_tanh_gate_triton
from ...ops.logit_softcap import logit_softcap
from ...ops.rmsnorm_scaled import rmsnorm_scaled, rmsnorm_scaled_triton
from ...ops.rotary_half import apply_rotary_half, cos_sin, inv_freq
from ...ops.sliding_window_attention import (sliding_window_decode, window_attention,
                                             window_attention_sdpa)
from .config import SLIDING, TextCfg
from .kv_cache import KVCache
from .weights import lm_head, text_layer

ATTENTION_SCALE = 1.0


class NormOps(NamedTuple):
    """The RMSNorm, the gated GELU and the attention of several tokens a pass uses: the
    references (torch ops, the default), or their fast forms (FAST: the fast encode's prefix
    pass on CUDA - the norm and the gate as one Triton launch each instead of ~8 torch ops,
    the attention by SDPA with the window / block mask instead of an fp32 score matrix; the
    same math, not the same bits)."""
    norm: Callable = rmsnorm_scaled
    gate: Callable = gelu_tanh_gate
    attend: Callable = window_attention


REFERENCE = NormOps()
FAST = NormOps(rmsnorm_scaled_triton, gelu_tanh_gate_triton, window_attention_sdpa)


def fast_ops_on(t: torch.Tensor) -> NormOps:
    """FAST for a tensor on CUDA, REFERENCE elsewhere (the CPU runs the torch ops)."""
    return FAST if t.is_cuda else REFERENCE


def rope_freqs(cfg: TextCfg) -> dict[str, torch.Tensor]:
    """Inverse frequencies per layer type (each type has its own head size and RoPE)."""
    out = {}
    for ty, r in cfg.rope.items():
        dim = cfg.head_dim if ty == SLIDING else cfg.global_head_dim
        out[ty] = inv_freq(dim, r.theta, r.rotary_fraction, r.factor)
    return out


def embed(w, cfg: TextCfg, ids: torch.Tensor) -> torch.Tensor:
    """ids [S] -> [S, hidden]."""
    table = w["language_model.embed_tokens.weight"]
    return table[ids] * torch.tensor(cfg.hidden ** 0.5, dtype=table.dtype)


def per_layer_inputs(w, cfg: TextCfg, ple_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """ple_ids [S] (pad id at image positions), x [S, hidden] the input embeddings
    -> [S, n_layers, P], or None for a model without per-layer embeddings."""
    if not cfg.ple_dim:
        return None
    L, P = cfg.n_layers, cfg.ple_dim
    table = w["language_model.embed_tokens_per_layer.weight"]
    # the table may live in host memory (load_model(ple_on_cpu=True)): gather there, move rows
    token = (table[ple_ids.to(table.device)] * torch.tensor(P ** 0.5, dtype=table.dtype)
             ).to(x.device).view(-1, L, P)
    ctx = (x @ w["language_model.per_layer_model_projection.weight"].T) * cfg.hidden ** -0.5
    ctx = rmsnorm_scaled(ctx.view(-1, L, P), w["language_model.per_layer_projection_norm.weight"],
                         cfg.eps)
    return (ctx + token) * 2.0 ** -0.5


def _qkv(w, cfg: TextCfg, i: int, h: torch.Tensor, cos, sin, cache: KVCache, pos0: int,
         ops: NormOps = REFERENCE):
    """Queries [Hq, S, D]; for a layer that computes k/v, writes them to the cache."""
    D = cfg.head_dim_of(i)
    S = h.shape[0]
    q = (h @ w[text_layer(i, "self_attn.q_proj.weight")].T).view(S, -1, D)
    q = apply_rotary_half(ops.norm(q, w[text_layer(i, "self_attn.q_norm.weight")], cfg.eps),
                          cos, sin)
    if i < cfg.first_shared:
        k_raw = (h @ w[text_layer(i, "self_attn.k_proj.weight")].T).view(S, -1, D)
        v_raw = k_raw if cfg.k_eq_v_of(i) else \
            (h @ w[text_layer(i, "self_attn.v_proj.weight")].T).view(S, -1, D)
        k = apply_rotary_half(
            ops.norm(k_raw, w[text_layer(i, "self_attn.k_norm.weight")], cfg.eps), cos, sin)
        v = ops.norm(v_raw, None, cfg.eps)
        cache.write(i, pos0, k.transpose(0, 1), v.transpose(0, 1))
    return q.transpose(0, 1)


def rotary_tables(cfg: TextCfg, freqs, positions: torch.Tensor, dtype) -> dict:
    """cos/sin [S, D] per layer type for these positions (computed once per forward)."""
    return {ty: cos_sin(positions, f, dtype) for ty, f in freqs.items()}


def attention(w, cfg: TextCfg, i: int, h: torch.Tensor, pos0: int, cache: KVCache, rot: dict,
              blocks: torch.Tensor | None = None, ops: NormOps = REFERENCE) -> torch.Tensor:
    S = h.shape[0]
    ty = cfg.layer_types[i]
    positions = torch.arange(pos0, pos0 + S, device=h.device)
    q = _qkv(w, cfg, i, h, *rot[ty], cache, pos0, ops)
    src = cfg.kv_source(i)
    window = cfg.sliding_window if ty == SLIDING else None
    end = pos0 + S
    if S == 1 and blocks is None:
        a = sliding_window_decode(q[:, 0], cache.k[src], cache.v[src], pos0, window,
                                  ATTENTION_SCALE)[:, None]
    else:
        a = ops.attend(q, cache.k[src][:, :end], cache.v[src][:, :end], positions, window,
                       ATTENTION_SCALE, blocks if ty == SLIDING else None)
    a = a.transpose(0, 1).reshape(S, -1)
    return a @ w[text_layer(i, "self_attn.o_proj.weight")].T


def mlp(w, i: int, h: torch.Tensor, ops: NormOps = REFERENCE) -> torch.Tensor:
    g = h @ w[text_layer(i, "mlp.gate_proj.weight")].T
    u = h @ w[text_layer(i, "mlp.up_proj.weight")].T
    return ops.gate(g, u) @ w[text_layer(i, "mlp.down_proj.weight")].T


def per_layer_residual(w, i: int, x: torch.Tensor, ple_i: torch.Tensor,
                       ops: NormOps = REFERENCE) -> torch.Tensor:
    g = x @ w[text_layer(i, "per_layer_input_gate.weight")].T
    return ops.gate(g, ple_i) @ w[text_layer(i, "per_layer_projection.weight")].T


def layer(w, cfg: TextCfg, i: int, x, ple, pos0: int, cache: KVCache, rot: dict, blocks=None,
          ops: NormOps = REFERENCE):
    def norm(t, name):
        return ops.norm(t, w[text_layer(i, name + ".weight")], cfg.eps)

    a = attention(w, cfg, i, norm(x, "input_layernorm"), pos0, cache, rot, blocks, ops)
    x = x + norm(a, "post_attention_layernorm")
    m = mlp(w, i, norm(x, "pre_feedforward_layernorm"), ops)
    x = x + norm(m, "post_feedforward_layernorm")
    if ple is not None:
        x = x + norm(per_layer_residual(w, i, x, ple[:, i], ops), "post_per_layer_input_norm")
    return x * w[text_layer(i, "layer_scalar")]


def decoder(w, cfg: TextCfg, x: torch.Tensor, ple, pos0: int, cache: KVCache, freqs,
            blocks: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, hidden] at positions pos0.. -> final-normed hidden states [S, hidden]."""
    rot = rotary_tables(cfg, freqs, torch.arange(pos0, pos0 + x.shape[0], device=x.device), x.dtype)
    for i in range(cfg.n_layers):
        x = layer(w, cfg, i, x, ple, pos0, cache, rot, blocks)
    return rmsnorm_scaled(x, w["language_model.norm.weight"], cfg.eps)


def prefix_kv(w, cfg: TextCfg, x: torch.Tensor, ple, cache: KVCache, freqs,
              blocks: torch.Tensor | None = None, ops: NormOps = REFERENCE) -> None:
    """decoder's k/v of a prefix at position 0, into cache, without its hidden states: only
    the layers that store k/v run (0 .. first_shared - 1). The KV-shared layers after them
    read their source layer's k/v and change only the hidden states, which nothing in the
    cache depends on - so the cache is decoder's, bit for bit, for (first_shared /
    n_layers) of its work (E2B: 15 of 35 layers). ops: FAST for the fast encode."""
    rot = rotary_tables(cfg, freqs, torch.arange(x.shape[0], device=x.device), x.dtype)
    for i in range(cfg.first_shared):
        x = layer(w, cfg, i, x, ple, 0, cache, rot, blocks, ops)


def logits(w, cfg: TextCfg, h: torch.Tensor) -> torch.Tensor:
    return logit_softcap(h @ lm_head(w).T, cfg.final_softcap)
