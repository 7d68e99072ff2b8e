"""Qwen 3.5's decode step as a program for the runtime's backends (photon_core/program.py):
the hybrid decoder of decoder.py written once as ops, run by the eager backend (the ops'
torch references) and the fused backend, for decode steps and prompt prefills alike.

Layer i (pre-norm residual, zero-centred RMSNorm "rms_zc"):
  linear_attention (Gated DeltaNet):
    h            = rms_zc(x)                                   input_layernorm
    qkv, z, b, a = h W^T                                       in_proj_qkv / _z / _b / _a (one GEMV)
    qkv_c        = conv1d(qkv)          state ("conv", i)      [conv_dim, K-1]
    o            = delta_rule(qkv_c, b, a)  state ("recurrent", i), fp32 [Hv, Dk, Dv]
    on           = gated_norm(o, z)     per value head         norm
    x           += on Wout^T                                   out_proj
  full_attention:
    qg, k, v     = h W^T                                       q_proj (q | gate per head), k_proj, v_proj
    a            = gated_attention(qg, k, v)  state ("kv", i): q/k norms, M-RoPE, GQA, gate
    x           += a Wo^T                                      o_proj
  mlp: h = rms_zc(x); gate, up = h W^T; m = silu(gate) * up; x += m Wdown^T
Buffers: h [D]; u = [qg | k | v | a | qkv | z | b | a_in | qkv_c | o | on | gate | up | m]
(the projections of one op lie side by side: one GEMV each in the fused backend).
Head lm: rms_zc(norm) + lm_head. Feedback: the token's embedding (one phase: text).
"""
from __future__ import annotations

from ...program import (AttentionSpec, DeltaSpec, Feedback, Head, LayerState, Program,
                        ProgramBuilder, StepSpec)
from .config import TextConfig

L = "model.language_model."
PHASE_TEXT = 0
PHASE_NEXT = ((PHASE_TEXT,),)       # one phase, one row kind


def step_program(t: TextConfig) -> Program:
    hq, hkv, d = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    hk, hv, dk, dv = (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim,
                      t.linear_value_head_dim)
    eps = t.rms_norm_eps
    b = ProgramBuilder()
    state = []
    for i, kind in enumerate(t.layer_types):
        p = f"{L}layers.{i}."
        b.norm("x", "h", p + "input_layernorm", kind="rms_zc", eps=eps)
        if kind == "linear_attention":
            la = p + "linear_attn."
            b.linear("h", ["qkv", "z", "b_in", "a_in"], [la + "in_proj_qkv", la + "in_proj_z",
                                                         la + "in_proj_b", la + "in_proj_a"])
            b.conv1d("qkv", "qkv_c", la + "conv1d", layer=i)
            b.delta_rule("qkv_c", "b_in", "a_in", "o", la + "A_log", la + "dt_bias", layer=i)
            b.gated_norm("o", "z", "on", la + "norm", size=dv, eps=eps)
            b.residual(["on"], [la + "out_proj"])
            state += [LayerState("conv", i, (t.conv_dim, t.linear_conv_kernel_dim - 1)),
                      LayerState("recurrent", i, (hv, dk, dv), dtype="fp32")]
        else:
            sa = p + "self_attn."
            b.linear("h", ["qg", "k", "v"], [sa + "q_proj", sa + "k_proj", sa + "v_proj"])
            b.gated_attention("qg", "k", "v", "a", sa + "q_norm", sa + "k_norm", layer=i,
                              eps=eps)
            b.residual(["a"], [sa + "o_proj"])
            state.append(LayerState("kv", i))
        b.norm("x", "h", p + "post_attention_layernorm", kind="rms_zc", eps=eps)
        b.linear("h", ["gate", "up"], [p + "mlp.gate_proj", p + "mlp.up_proj"])
        b.act_mul("gate", "up", "m", "silu")
        b.residual(["m"], [p + "mlp.down_proj"])
    lm = ProgramBuilder()
    lm.norm("hidden", "h", L + "norm", kind="rms_zc", eps=eps)
    lm.linear("h", ["logits"], ["lm_head"])
    ff = t.intermediate_size
    return Program(
        dim=t.hidden_size,
        buffers=(("h", (("h", t.hidden_size),)),
                 ("u", (("qg", hq * 2 * d), ("k", hkv * d), ("v", hkv * d), ("a", hq * d),
                        ("qkv", t.conv_dim), ("z", hv * dv), ("b_in", hv), ("a_in", hv),
                        ("qkv_c", t.conv_dim), ("o", hv * dv), ("on", hv * dv),
                        ("gate", ff), ("up", ff), ("m", ff))),
                 ("logits", (("logits", t.vocab_size),))),
        ops=b.build(),
        attention=AttentionSpec(hq, hkv, d, t.rot_dim, t.rope_theta, tuple(t.mrope_section)),
        state=tuple(state),
        heads=(("lm", Head(lm.build(), "logits", col=0)),),
        feedback=Feedback("token", (("wte", L + "embed_tokens.weight"),)),
        final_norm=L + "norm", vocab=t.vocab_size, delta=DeltaSpec(hk, hv, dk, dv))


def step_spec(config) -> StepSpec:
    """The runtime's view of the decoder: the program, a one-phase table, no answer marker."""
    return StepSpec(step_program(config.text), PHASE_NEXT, answer_id=None)
