"""Qwen 3.5's hybrid text decoder (reference): one forward over T new tokens, continuing a
HybridState. T > 1 is a prefill (chunked delta rule, conv over the sequence), T == 1 a decode
step (recurrent delta-rule step, conv step); both read and update the same state.

Layer i (pre-norm residual, zero-centred RMSNorm x * (1 + w)):
  linear_attention (Gated DeltaNet):
    qkv = conv1d_silu(in_proj_qkv(x)) -> q, k [Hk, Dk], v [Hv, Dv]
    beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)    (fp32 state [Hv, Dk, Dv])
    out_proj(rmsnorm_gated(o, z = in_proj_z(x)))
  full_attention: q_proj -> (query, gate) per head; q_norm / k_norm per head; M-RoPE on the
    first rot_dim dims; causal GQA over the k/v cache; o_proj(attn * sigmoid(gate))
  mlp: down(silu(gate(x)) * up(x))
Weights by Hugging Face name (model.language_model.*, lm_head.weight).

forward(..., use_kernels=True) runs a decode step (T == 1) through the Triton kernels that sit
beside each op's reference (fused residual add + norm, conv step, delta-rule step, gated norm,
fused q/k norm + M-RoPE written straight into the k cache, split-sequence gated attention);
a prefill (T > 1) uses only the chunked delta-rule kernel, the rest stays torch. Off by
default (on the CPU the kernels only run under TRITON_INTERPRET=1, for tests).
forward(..., fused_norms=True) (the engine's fast image-prefix encode, T > 1): every
zero-centred / gated RMSNorm (the residual add fused in), the MLP's SiLU(gate) * up (and,
with FAST_CONV, the causal conv in the in-projection's row layout) as one Triton launch each
instead of a handful of torch ops, and the chunked delta rule's fast
form (gated_delta_chunked(fast=True): its fp32 matmuls on TF32 tensor cores on CUDA, one
triangular solve), the full-attention layers of a pass from position 0 by SDPA's fused causal
kernel: the same math, not the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.causal_conv1d import (causal_conv1d_prefill, causal_conv1d_prefill_triton,
                                  causal_conv1d_step, causal_conv1d_step_triton)
from ...ops.gated_delta_rule import (delta_gates, gated_delta_chunked, gated_delta_chunked_triton,
                                     gated_delta_step, gated_delta_step_triton)
from ...ops.gqa_attention import gated_gqa_decode_triton, gqa_attention
from ...ops.mrope import apply_rope, mrope_cos_sin, qk_norm_rope_triton
from ...ops.rmsnorm_gated import rmsnorm_gated, rmsnorm_gated_triton
from ...ops.rmsnorm_zero_centred import rmsnorm_zero_centred, rmsnorm_zero_centred_triton
from ...ops.silu_gate import silu_gate_triton
from ...weight_layout import adjacent_rows
from .config import TextConfig
from .state import HybridState

L = "model.language_model."
# The fast encode's causal conv as one Triton launch in the in-projection's row layout
# (causal_conv1d_prefill_triton; on since session 17 call 1: Qwen 3.5 0.8B's 640x480
# encode graph replay 9.62 -> 8.57-8.64 ms, in place of transpose + cat + depthwise conv)
FAST_CONV = True
# The fast encode's four DeltaNet in-projections (qkv, z, b, a) as one GEMM where the weights
# lie in consecutive rows of one tensor (weight_layout.adjacent_rows: the fused backend's
# joined [qkv; z; b; a] once an engine shares the weights); else four
JOINED_IN_PROJ = True
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def embed(w: dict, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, w[L + "embed_tokens.weight"])


def mlp(w: dict, i: int, x: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    p = f"{L}layers.{i}.mlp."
    g, u = F.linear(x, w[p + "gate_proj.weight"]), F.linear(x, w[p + "up_proj.weight"])
    return F.linear(silu_gate_triton(g, u) if kernel else F.silu(g) * u,
                    w[p + "down_proj.weight"])


def deltanet(w: dict, cfg: TextConfig, i: int, x: torch.Tensor, state: HybridState,
             kernels: bool = False, fused_norms: bool = False) -> torch.Tensor:
    """x [T, D] (normed) -> [T, D]; updates state.conv[i], state.recurrent[i]."""
    p = f"{L}layers.{i}.linear_attn."
    t = x.shape[0]
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    joined = adjacent_rows([w[p + n + ".weight"] for n in IN_PROJ]) \
        if fused_norms and t > 1 and JOINED_IN_PROJ else None
    if joined is not None:      # the four in-projections as one GEMM (column views of it)
        mixed, z, b, a = F.linear(x, joined).split(
            [w[p + n + ".weight"].shape[0] for n in IN_PROJ], dim=-1)
    else:                       # mixed: [T, conv_dim]
        mixed, z, b, a = (F.linear(x, w[p + n + ".weight"]) for n in IN_PROJ)
    conv_w = w[p + "conv1d.weight"][:, 0]                                  # [conv_dim, K]
    if t == 1:
        conv_step = causal_conv1d_step_triton if kernels else causal_conv1d_step
        mixed = conv_step(mixed, conv_w, state.conv[i])                    # [1, conv_dim]
    elif fused_norms and FAST_CONV:     # the conv in the GEMM output's row layout
        mixed, state.conv[i] = causal_conv1d_prefill_triton(mixed, conv_w, state.conv[i])
    else:
        out, state.conv[i] = causal_conv1d_prefill(mixed.T[None], conv_w, state.conv[i])
        mixed = out[0].T
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    a_log, dt_bias = w[p + "A_log"], w[p + "dt_bias"]
    if t == 1 and kernels:                              # the kernel applies delta_gates itself
        o = gated_delta_step_triton(q, k, v, a, b, state.recurrent[i], a_log=a_log,
                                    dt_bias=dt_bias)                       # [1, Hv, Dv]
    elif t == 1:
        g, beta = delta_gates(a, b, a_log, dt_bias)
        o = gated_delta_step(q, k, v, g, beta, state.recurrent[i])         # [1, Hv, Dv]
    else:
        if kernels:
            g, beta = delta_gates(a, b, a_log, dt_bias)
            o, state.recurrent[i] = gated_delta_chunked_triton(
                q[None], k[None], v[None], g[None], beta[None], state.recurrent[i])
        else:   # the reference form, or with fused_norms the fast encode's (TF32 matmuls,
            #     one solve); the gates from a and b (raw_gates: by delta_gates, or in the
            #     fast form's prep kernel)
            o, state.recurrent[i] = gated_delta_chunked(
                q[None], k[None], v[None], a[None], b[None], state.recurrent[i],
                fast=fused_norms, raw_gates=(a_log, dt_bias))
        o = o[0]                                                           # [T, Hv, Dv]
    z = z.reshape(t, hv, dv)
    o = (rmsnorm_gated_triton if kernels and t == 1 or fused_norms else rmsnorm_gated)(
        o, z, w[p + "norm.weight"], cfg.rms_norm_eps)
    return F.linear(o.reshape(t, hv * dv), w[p + "out_proj.weight"])


def attention(w: dict, cfg: TextConfig, i: int, x: torch.Tensor, cos, sin,
              state: HybridState, kernels: bool = False, fused_norms: bool = False
              ) -> torch.Tensor:
    """x [T, D] (normed) -> [T, D]; writes k/v at state.length .. + T."""
    p = f"{L}layers.{i}.self_attn."
    t, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = F.linear(x, w[p + "q_proj.weight"]).reshape(t, hq, 2 * d)
    if kernels and t == 1:
        return _attention_step_kernels(w, cfg, i, x, qg[0], cos, sin, state)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    norm = rmsnorm_zero_centred_triton if fused_norms else rmsnorm_zero_centred
    q = norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps).transpose(0, 1)
    k = F.linear(x, w[p + "k_proj.weight"]).reshape(t, hkv, d)
    k = norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps).transpose(0, 1)
    v = F.linear(x, w[p + "v_proj.weight"]).reshape(t, hkv, d).transpose(0, 1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    start = state.length
    if start + t > state.k[i].shape[1]:
        raise ValueError(f"k/v cache full: {start} + {t} > {state.k[i].shape[1]} positions")
    state.k[i][:, start:start + t] = k
    state.v[i][:, start:start + t] = v
    if fused_norms and start == 0:      # the fast encode's prefix: SDPA's fused causal kernel
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                           enable_gqa=True)[0]
    else:
        o = gqa_attention(q, state.k[i][:, :start + t], state.v[i][:, :start + t], start)
    o = o.transpose(0, 1).reshape(t, hq * d) * torch.sigmoid(gate)
    return F.linear(o, w[p + "o_proj.weight"])


def _attention_step_kernels(w, cfg, i, x, qg, cos, sin, state) -> torch.Tensor:
    """attention() for one token through the Triton kernels; qg [Hq, 2D] (query | gate)."""
    p = f"{L}layers.{i}.self_attn."
    hkv, d, start = cfg.num_key_value_heads, cfg.head_dim, state.length
    if start + 1 > state.k[i].shape[1]:
        raise ValueError(f"k/v cache full: {start} + 1 > {state.k[i].shape[1]} positions")
    k = F.linear(x, w[p + "k_proj.weight"]).reshape(hkv, d)
    q, _ = qk_norm_rope_triton(qg[:, :d], k, w[p + "q_norm.weight"], w[p + "k_norm.weight"],
                               cos[0], sin[0], cfg.rms_norm_eps, k_out=state.k[i][:, start])
    state.v[i][:, start] = F.linear(x, w[p + "v_proj.weight"]).reshape(hkv, d)
    o = gated_gqa_decode_triton(q, state.k[i], state.v[i], start + 1, gate=qg[:, d:])
    return F.linear(o.reshape(1, -1), w[p + "o_proj.weight"])


def _add_norm(x, delta, weight, eps, kernels: bool):
    """-> (x + delta, its zero-centred RMSNorm); delta None: (x, norm(x))."""
    if kernels:
        if delta is None:
            return x, rmsnorm_zero_centred_triton(x, weight, eps)
        return rmsnorm_zero_centred_triton(x, weight, eps, delta=delta)
    if delta is not None:
        x = x + delta
    return x, rmsnorm_zero_centred(x, weight, eps)


def text_positions(start: int, t: int, device) -> torch.Tensor:
    """[3, T]: three equal rows start .. start+T-1 (text tokens)."""
    return torch.arange(start, start + t, device=device)[None].expand(3, t)


def forward(w: dict, cfg: TextConfig, x: torch.Tensor, positions: torch.Tensor,
            state: HybridState, use_kernels: bool | None = False,
            fused_norms: bool = False) -> torch.Tensor:
    """x [T, D] embeddings, positions [3, T] -> final-normed hidden [T, D]; advances state.
    use_kernels: a decode step (T == 1) runs through the Triton kernels, a prefill through the
    chunked delta-rule kernel; None: kernels when x is on a GPU. fused_norms: the norms and
    the MLP's gate as Triton kernels (module docstring)."""
    if use_kernels is None:
        use_kernels = x.is_cuda
    kern = use_kernels and x.shape[0] == 1          # the one-token kernels
    fn = fused_norms or kern
    eps = cfg.rms_norm_eps
    cos, sin = mrope_cos_sin(positions, cfg.rot_dim, cfg.rope_theta, cfg.mrope_section, x.dtype)
    delta = None                         # the residual branch not yet added to x
    for i, kind in enumerate(cfg.layer_types):
        p = f"{L}layers.{i}."
        x, h = _add_norm(x, delta, w[p + "input_layernorm.weight"], eps, fn)
        if kind == "linear_attention":
            delta = deltanet(w, cfg, i, h, state, use_kernels, fused_norms)
        else:
            delta = attention(w, cfg, i, h, cos, sin, state, kern, fused_norms)
        x, h = _add_norm(x, delta, w[p + "post_attention_layernorm.weight"], eps, fn)
        delta = mlp(w, i, h, fused_norms)
    state.length += x.shape[0]
    return _add_norm(x, delta, w[L + "norm.weight"], eps, fn)[1]


def logits(w: dict, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, w["lm_head.weight"])
