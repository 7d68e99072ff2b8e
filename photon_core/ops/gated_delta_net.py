"""A Gated DeltaNet layer's stateful ops in the runtime's forms (torch references): the causal
conv and the gated delta rule over the state cache's rows (a decode step: one token per row,
rows at different positions) and over one row's prompt (a prefill), built from the ops'
single-sequence references (causal_conv1d.py, gated_delta_rule.py; Qwen 3.5's reference
decoder runs those). State is only written for the step's active rows (a row riding along in
a bucket keeps its state) and, in a prefill padded to a bucket, only the first `n_valid`
tokens reach the state (the padding: g = 0, beta = 0 and a conv window ending at n_valid).

Shapes: qkv [b, 2 Hk Dk + Hv Dv] (q | k | v, after the in-projection), b_in / a_in [b, Hv]
(the beta and decay projections), conv state [rows, C, K-1], delta state [rows, Hv, Dk, Dv]
fp32; the delta rule's output [b, Hv Dv] in qkv's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .causal_conv1d import causal_conv1d_prefill, causal_conv1d_step
from .gated_delta_rule import gated_delta_chunked, gated_delta_step


def _keep(active: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> None:
    """old[r] = new[r] for active rows r (all rows when active is None)."""
    if active is None:
        old.copy_(new)
    else:
        old.copy_(torch.where(active.view(-1, *([1] * (old.dim() - 1))), new, old))


def conv1d_rows(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                active: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: x [b, C], weight [C, K], state [b, C, K-1] -> SiLU(conv) [b, C]."""
    new = state.clone()
    out = causal_conv1d_step(x, weight, new)
    _keep(active, new, state)
    return out


def conv1d_prefill_row(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The prompt of one row: x [T, C], state [1, C, K-1] (updated: the K-1 inputs before
    token n_valid) -> [T, C]."""
    out, new = causal_conv1d_prefill(x.T[None], weight, state)
    if n_valid is not None:
        k1 = state.shape[-1]
        full = torch.cat([state.to(x.dtype), x.T[None]], dim=-1)
        idx = n_valid.reshape(1) + torch.arange(k1, device=x.device)
        new = full.index_select(2, idx)
    state.copy_(new)
    return out[0].T


def _split(qkv, b_in, a_in, a_log, dt_bias, hk, hv, dk, dv):
    t = qkv.shape[0]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    beta = torch.sigmoid(b_in)
    g = -a_log.float().exp() * F.softplus(a_in.float() + dt_bias)
    return q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g, beta


def delta_rule_rows(qkv, b_in, a_in, a_log, dt_bias, state, dims,
                    active: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row; dims (Hk, Hv, Dk, Dv); state [b, Hv, Dk, Dv] fp32 -> [b, Hv Dv]."""
    hk, hv, dk, dv = dims
    q, k, v, g, beta = _split(qkv, b_in, a_in, a_log, dt_bias, hk, hv, dk, dv)
    new = state.clone()
    o = gated_delta_step(q, k, v, g, beta, new)
    _keep(active, new, state)
    return o.reshape(qkv.shape[0], hv * dv)


def delta_rule_prefill_row(qkv, b_in, a_in, a_log, dt_bias, state, dims,
                           n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The prompt of one row (chunked form); state [1, Hv, Dk, Dv] fp32, updated by the first
    n_valid tokens -> [T, Hv Dv]."""
    hk, hv, dk, dv = dims
    t = qkv.shape[0]
    q, k, v, g, beta = _split(qkv, b_in, a_in, a_log, dt_bias, hk, hv, dk, dv)
    if n_valid is not None:          # padding tokens: no decay, no write
        real = (torch.arange(t, device=qkv.device) < n_valid.reshape(1))[:, None]
        g = torch.where(real, g, torch.zeros_like(g))
        beta = torch.where(real, beta, torch.zeros_like(beta))
    o, new = gated_delta_chunked(q[None], k[None], v[None], g[None], beta[None], state)
    state.copy_(new)
    return o[0].reshape(t, hv * dv)
