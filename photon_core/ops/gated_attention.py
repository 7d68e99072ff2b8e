"""Qwen 3.5's gated full attention in the runtime's forms (torch references): per-head
zero-centred RMSNorm of q and k, rotate-half rotary (M-RoPE with three equal position rows:
text tokens) at the row's position plus its position offset, the new k/v written into the
state cache at the row's (clamped) cache position, causal GQA over the row's cache, and the
output gate sigmoid(gate). Built from the single-sequence references (rmsnorm_zero_centred.py,
mrope.py, gqa_attention.py: the same math, rows at different positions masked per row).

qg [n, Hq * 2D] (per head: q then its gate, as q_proj lays them out), k, v [n, Hkv * D];
kc, vc: one layer of the cache [rows, Hkv, capacity, D]. Output [n, Hq * D] in qg's dtype.
"""
from __future__ import annotations

import torch

from .mrope import apply_rope, mrope_cos_sin
from .rmsnorm_zero_centred import rmsnorm_zero_centred


def _prepare(qg, k, v, q_norm, k_norm, rope_pos, a, eps):
    n, hq, hkv, d = qg.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
    qg = qg.reshape(n, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, hq * d)
    q = rmsnorm_zero_centred(q, q_norm, eps)
    k = rmsnorm_zero_centred(k.reshape(n, hkv, d), k_norm, eps)
    cos, sin = mrope_cos_sin(rope_pos[None].expand(3, n), a.rot_dim, a.theta, a.mrope_section,
                             qg.dtype)
    q = apply_rope(q.transpose(0, 1), cos, sin).transpose(0, 1)       # [n, Hq, D]
    k = apply_rope(k.transpose(0, 1), cos, sin).transpose(0, 1)       # [n, Hkv, D]
    return q, k, v.reshape(n, hkv, d), gate


def _attend(q, keys, values, mask, gate):
    """q [n, Hq, D]; keys/values [n, Hkv, L, D]; mask [n, L] True = attend. Each k/v head
    serves Hq/Hkv consecutive query heads (as gqa_attention's repeat_interleave)."""
    n, hq, d = q.shape
    hkv = keys.shape[1]
    qf = q.float().reshape(n, hkv, hq // hkv, d)
    scores = (qf @ keys.float().transpose(-1, -2)) * d ** -0.5           # [n, Hkv, rep, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = (scores.softmax(-1) @ values.float()).to(q.dtype)                # [n, Hkv, rep, D]
    return o.reshape(n, hq * d) * torch.sigmoid(gate)


def gated_attention_rows(qg, k, v, q_norm, k_norm, kc, vc, rows, pos, rope_pos, attn_len,
                         a, eps=1e-6):
    """A decode step: row i's token at cache position pos[i] (rotary at rope_pos[i])."""
    q, k, v, gate = _prepare(qg, k, v, q_norm, k_norm, rope_pos, a, eps)
    pos_w = pos.clamp(max=kc.shape[2] - 1)
    kc[rows, :, pos_w] = k
    vc[rows, :, pos_w] = v
    keys, values = kc[rows, :, :attn_len], vc[rows, :, :attn_len]
    mask = torch.arange(attn_len, device=pos.device)[None, :] <= pos[:, None]
    return _attend(q, keys, values, mask, gate)


def gated_attention_prefill(qg, k, v, q_norm, k_norm, kc, vc, row, pos, rope_pos, a,
                            eps=1e-6):
    """The prompt of one row (`row` [1]): token t at cache position pos[t], causal over the
    row's whole cache."""
    q, k, v, gate = _prepare(qg, k, v, q_norm, k_norm, rope_pos, a, eps)
    cap = kc.shape[2]
    pos_w = pos.clamp(max=cap - 1)
    kc[row, :, pos_w] = k
    vc[row, :, pos_w] = v
    n, hq, d = q.shape
    keys, values = kc.index_select(0, row)[0], vc.index_select(0, row)[0]    # [Hkv, cap, D]
    hkv = keys.shape[0]
    qf = q.float().transpose(0, 1).reshape(hkv, (hq // hkv) * n, d)
    scores = (qf @ keys.float().transpose(-1, -2)) * d ** -0.5           # [Hkv, rep*n, cap]
    mask = torch.arange(cap, device=pos.device)[None, :] <= pos[:, None]   # [n, cap]
    scores = scores.view(hkv, hq // hkv, n, cap).masked_fill(~mask, float("-inf"))
    o = (scores.softmax(-1).view(hkv, -1, cap) @ values.float()).to(q.dtype)  # [Hkv, rep*n, D]
    o = o.view(hq, n, d).transpose(0, 1).reshape(n, hq * d)
    return o * torch.sigmoid(gate)
