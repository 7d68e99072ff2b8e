"""Gemma 4's decode step as a step program (photon_core/program.py): the decoder of text.py
written once as ops over the checkpoint's weight names, row buffers and per-layer state, for
the runtime's backends (fast/eager_backend.py, fast/fused_backend.py), decode steps and
prompt prefills alike.

Per layer i (sandwich norms; every norm is Gemma's RMSNorm times w):
  norm        x -> h                              input_layernorm
  linear      h -> [q, k, v]  (KV-shared layers: [q]; keys = values: [q, k])
  window_attention (q, k, v) -> a, layer i        q/k norms (weights), scale-free v norm,
              rotary of the layer type at the row's position, k/v written into the layer's
              state (sliding layers: a ring of `window` slots; global layers: full length),
              attention with scale 1 over the state of `source` (KV-shared layers read their
              source layer's, write nothing), sliding layers limited to the window
  linear      a -> o                              o_proj
  norm        o -> h                              post_attention_layernorm
  add         x += h
  norm        x -> h                              pre_feedforward_layernorm
  linear      h -> [gate, up]; act_mul gelu_tanh(gate) * up -> m; linear m -> o (down)
  norm        o -> h; add x += h                  post_feedforward_layernorm
  (PLE) linear x -> pg; act_mul gelu_tanh(pg) * ple.i -> pm; linear pm -> o;
        norm o -> h (post_per_layer_input_norm); add x += h
  scale       x *= layer_scalar
Before layer 0: per_layer_input (x, ple_tok) -> ple.0 .. ple.{L-1}: RMSNorm per layer of
(x W_proj^T * hidden^-0.5) (weight per_layer_projection_norm), plus the token part, times
2^-0.5. The feedback ("gemma_token") turns the sampled token into x = embed[id] * sqrt(hidden)
and ple_tok = embed_per_layer[id] * sqrt(P). The lm head: norm, the tied lm_head, softcap.

The op kinds add, scale, per_layer_input, window_attention, softcap, the per-layer attention
parameters (program.LayerAttention, the window_attention op's "attn" param), the "ring"
state and the "scaled_token" feedback are the runtime's (photon_core/program.py): the
runtime (fast/eager_backend.py, fast/fused_backend.py, fast/window_state_ops.py,
fast/static_kv_cache.py) runs this program like any other.
"""
from __future__ import annotations

from ...program import (AttentionSpec, Feedback, Head, LayerAttention, LayerState, Program,
                        ProgramBuilder, StepSpec)
from .config import SLIDING, TextCfg
from .weights import text_layer

EMBED = "language_model.embed_tokens.weight"
EMBED_PER_LAYER = "language_model.embed_tokens_per_layer.weight"
PHASE_NEXT = ((0,),)         # one text phase, one row kind


def layer_attention(cfg: TextCfg, i: int) -> LayerAttention:
    ty = cfg.layer_types[i]
    r = cfg.rope[ty]
    return LayerAttention(
        n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads_of(i), head_dim=cfg.head_dim_of(i),
        theta=r.theta, rotary_fraction=r.rotary_fraction, factor=r.factor,
        window=cfg.sliding_window if ty == SLIDING else None, source=cfg.kv_source(i),
        writes=i < cfg.first_shared, k_eq_v=cfg.k_eq_v_of(i))


def kind(la: LayerAttention) -> str:
    """"s" (sliding) or "f" (global): the layer type's buffer segments."""
    return "s" if la.window is not None else "f"


def layer_attentions(program: Program) -> tuple[LayerAttention, ...]:
    """The window_attention ops' per-layer parameters, by layer."""
    return tuple(op.param("attn") for op in program.ops if op.kind == "window_attention")


def step_program(cfg: TextCfg, tied: bool = True) -> Program:
    H, L, P, eps = cfg.hidden, cfg.n_layers, cfg.ple_dim, cfg.eps
    layers = tuple(layer_attention(cfg, i) for i in range(L))
    b = ProgramBuilder()
    if P:
        b.per_layer_input("x", "ple_tok", [f"ple.{i}" for i in range(L)],
                          "language_model.per_layer_model_projection",
                          "language_model.per_layer_projection_norm", eps=eps)
    for i, la in enumerate(layers):
        def w(name):
            return text_layer(i, name)
        t = kind(la)
        b.norm("x", "h", w("input_layernorm"), kind="rms", eps=eps)
        qkv = [f"q{t}"] + ([f"k{t}"] if la.writes else []) + \
            ([f"v{t}"] if la.writes and not la.k_eq_v else [])
        b.linear("h", qkv, [w("self_attn." + n + "_proj") for n in "qkv"[:len(qkv)]])
        b.window_attention(f"q{t}", f"k{t}", f"v{t}", f"a{t}", w("self_attn.q_norm"),
                           w("self_attn.k_norm"), i, la, eps=eps)
        b.linear(f"a{t}", ["o"], [w("self_attn.o_proj")])
        b.norm("o", "h", w("post_attention_layernorm"), kind="rms", eps=eps)
        b.add("h")
        n = cfg.mlp_width(i)
        b.norm("x", "h", w("pre_feedforward_layernorm"), kind="rms", eps=eps)
        b.linear("h", [f"gate.{n}", f"up.{n}"], [w("mlp.gate_proj"), w("mlp.up_proj")])
        b.act_mul(f"gate.{n}", f"up.{n}", f"m.{n}", "gelu_tanh")
        b.linear(f"m.{n}", ["o"], [w("mlp.down_proj")])
        b.norm("o", "h", w("post_feedforward_layernorm"), kind="rms", eps=eps)
        b.add("h")
        if P:
            b.linear("x", ["pg"], [w("per_layer_input_gate")])
            b.act_mul("pg", f"ple.{i}", "pm", "gelu_tanh")
            b.linear("pm", ["o"], [w("per_layer_projection")])
            b.norm("o", "h", w("post_per_layer_input_norm"), kind="rms", eps=eps)
            b.add("h")
        b.scale("x", w("layer_scalar"))
    lm = ProgramBuilder()
    lm.norm("hidden", "h", "language_model.norm", kind="rms", eps=eps)
    lm.linear("h", ["logits"], ["language_model.embed_tokens" if tied else "lm_head"])
    lm.softcap("logits", "logits", cfg.final_softcap)

    # buffers: every op's segments side by side where one GEMV writes them together
    u = []
    for t in ("s", "f"):
        las = [la for la in layers if kind(la) == t]
        if las:
            la = las[0]
            u += [(f"q{t}", la.n_heads * la.head_dim), (f"k{t}", la.n_kv_heads * la.head_dim),
                  (f"v{t}", la.n_kv_heads * la.head_dim), (f"a{t}", la.n_heads * la.head_dim)]
    for n in sorted({cfg.mlp_width(i) for i in range(L)}):
        u += [(f"gate.{n}", n), (f"up.{n}", n), (f"m.{n}", n)]
    if P:
        u += [("pg", P), ("pm", P)]
    buffers = [("h", (("h", H), ("o", H))), ("u", tuple(u))]
    if P:
        buffers.append(("ple", (("ple_tok", L * P),) + tuple((f"ple.{i}", P) for i in range(L))))
    buffers.append(("logits", (("logits", cfg.vocab_size),)))
    state = tuple(
        LayerState("ring", i, (la.n_kv_heads, la.window, la.head_dim)) if la.window is not None
        else LayerState("kv", i, (la.n_kv_heads, la.head_dim))
        for i, la in enumerate(layers) if la.writes)
    first = layers[0]
    return Program(
        dim=H, buffers=tuple(buffers), ops=b.build(),
        attention=AttentionSpec(first.n_heads, first.n_kv_heads, first.head_dim,
                                int(first.rotary_fraction * first.head_dim), first.theta),
        state=state, heads=(("lm", Head(lm.build(), "logits", col=0)),),
        feedback=Feedback("scaled_token", (("wte", EMBED),) + (
            (("extra", EMBED_PER_LAYER),) if P else ()),
            params=(("scale", H ** 0.5),) + (
                (("extra_segment", "ple_tok"), ("extra_scale", P ** 0.5)) if P else ())),
        final_norm="language_model.norm", vocab=cfg.vocab_size)


def step_spec(cfg: TextCfg, tied: bool = True) -> StepSpec:
    """The runtime's view of the decoder: the program, a one-phase table, no answer marker."""
    return StepSpec(step_program(cfg, tied), PHASE_NEXT, answer_id=None)
