"""Gemma 4's decode step as a step program (photon_core/program.py): the decoder of text.py
written once as ops over the checkpoint's weight names, row buffers and per-layer state, for
the runtime's backends (today: backend_ext.py, the eager and fused executors of the op kinds
below, until the runtime is model-agnostic).

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

New op kinds (beyond program.py's norm / linear / attention / residual / act_mul): add, scale,
per_layer_input, window_attention, softcap; the per-layer attention parameters live in
`Gemma4Program.layers` (program.py has one AttentionSpec for every layer); the state declares
"ring" layers (LayerState kind "ring", shape (n_kv_heads, window, head_dim)) besides "kv"
(shape (n_kv_heads, head_dim), capacity positions). docs/gemma4.md lists what program.py and
the backends need to run it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...program import AttentionSpec, Feedback, Head, LayerState, Op, Program, ProgramBuilder
from .config import SLIDING, TextCfg
from .weights import text_layer

EMBED = "language_model.embed_tokens.weight"
EMBED_PER_LAYER = "language_model.embed_tokens_per_layer.weight"


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: its own head size, k/v heads and RoPE; `window` (sliding
    layers) or None (global); `source` the layer whose state it reads (itself unless
    KV-shared); `writes` False for KV-shared layers; `k_eq_v`: v is the raw k."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float
    rotary_fraction: float
    factor: float
    window: int | None
    source: int
    writes: bool
    k_eq_v: bool
    scale: float = 1.0

    @property
    def kind(self) -> str:
        return "s" if self.window is not None else "f"


@dataclass(frozen=True)
class Gemma4Program(Program):
    layers: tuple[LayerAttention, ...] = ()
    softcap: float | None = None
    n_layers: int = 0
    ple_dim: int = 0
    eps: float = 1e-6

    def layer_state(self, layer: int) -> LayerState:
        return next(s for s in self.state if s.layer == layer)


class _Builder(ProgramBuilder):
    def op(self, kind, src, dst=(), weights=(), acts=(), layer=-1, eps=1e-6):
        self.ops.append(Op(kind, tuple(src), tuple(dst), tuple(weights), tuple(acts), layer,
                           "rms", eps))


def layer_attention(cfg: TextCfg, i: int) -> LayerAttention:
    ty = cfg.layer_types[i]
    r = cfg.rope[ty]
    return LayerAttention(
        n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads_of(i), head_dim=cfg.head_dim_of(i),
        theta=r.theta, rotary_fraction=r.rotary_fraction, factor=r.factor,
        window=cfg.sliding_window if ty == SLIDING else None, source=cfg.kv_source(i),
        writes=i < cfg.first_shared, k_eq_v=cfg.k_eq_v_of(i))


def step_program(cfg: TextCfg, tied: bool = True) -> Gemma4Program:
    H, L, P, eps = cfg.hidden, cfg.n_layers, cfg.ple_dim, cfg.eps
    layers = tuple(layer_attention(cfg, i) for i in range(L))
    b = _Builder()
    if P:
        b.op("per_layer_input", ("x", "ple_tok"), [f"ple.{i}" for i in range(L)],
             ("language_model.per_layer_model_projection",
              "language_model.per_layer_projection_norm"), eps=eps)
    for i, la in enumerate(layers):
        def w(name):
            return text_layer(i, name)
        t = la.kind
        b.norm("x", "h", w("input_layernorm"), kind="rms", eps=eps)
        qkv = [f"q{t}"] + ([f"k{t}"] if la.writes else []) + \
            ([f"v{t}"] if la.writes and not la.k_eq_v else [])
        b.linear("h", qkv, [w("self_attn." + n + "_proj") for n in "qkv"[:len(qkv)]])
        b.op("window_attention", (f"q{t}", f"k{t}", f"v{t}"), (f"a{t}",),
             (w("self_attn.q_norm"), w("self_attn.k_norm")), layer=i, eps=eps)
        b.linear(f"a{t}", ["o"], [w("self_attn.o_proj")])
        b.norm("o", "h", w("post_attention_layernorm"), kind="rms", eps=eps)
        b.op("add", ("h",), ("x",))
        n = cfg.mlp_width(i)
        b.norm("x", "h", w("pre_feedforward_layernorm"), kind="rms", eps=eps)
        b.linear("h", [f"gate.{n}", f"up.{n}"], [w("mlp.gate_proj"), w("mlp.up_proj")])
        b.act_mul(f"gate.{n}", f"up.{n}", f"m.{n}", "gelu_tanh")
        b.linear(f"m.{n}", ["o"], [w("mlp.down_proj")])
        b.norm("o", "h", w("post_feedforward_layernorm"), kind="rms", eps=eps)
        b.op("add", ("h",), ("x",))
        if P:
            b.linear("x", ["pg"], [w("per_layer_input_gate")])
            b.act_mul("pg", f"ple.{i}", "pm", "gelu_tanh")
            b.linear("pm", ["o"], [w("per_layer_projection")])
            b.norm("o", "h", w("post_per_layer_input_norm"), kind="rms", eps=eps)
            b.op("add", ("h",), ("x",))
        b.op("scale", ("x",), ("x",), (w("layer_scalar"),))
    lm = _Builder()
    lm.norm("hidden", "h", "language_model.norm", kind="rms", eps=eps)
    lm.linear("h", ["logits"], ["language_model.embed_tokens" if tied else "lm_head"])
    lm.op("softcap", ("logits",), ("logits",))

    # buffers: every op's segments side by side where one GEMV writes them together
    u = []
    for t in ("s", "f"):
        las = [la for la in layers if la.kind == t]
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
    return Gemma4Program(
        dim=H, buffers=tuple(buffers), ops=b.build(),
        attention=AttentionSpec(first.n_heads, first.n_kv_heads, first.head_dim,
                                int(first.rotary_fraction * first.head_dim), first.theta),
        state=state, heads=(("lm", Head(lm.build(), "logits", col=0)),),
        feedback=Feedback("gemma_token", (("wte", EMBED),) + (
            (("wte_pl", EMBED_PER_LAYER),) if P else ())),
        final_norm="language_model.norm", vocab=cfg.vocab_size,
        layers=layers, softcap=cfg.final_softcap, n_layers=L, ple_dim=P, eps=eps)
