"""A decode step as a program: a list of op instructions over named weights, named row
buffers and per-layer state, written once per model family and executed by the runtime's
backends (eager_backend.py: each op's torch reference; fused_backend.py: the Triton kernels).

Names. Every op reads and writes *segments*: named column ranges of the backend's row
buffers, one row per batch row (a decode step) or per prompt token (a prefill). `x` is the
residual stream (model dtype in the eager backend, fp32 in the fused one), `hidden` the
row's last hidden state (model dtype), `logits` a head's output. The program declares its
scratch buffers as ordered segment lists (`buffers`); segments that an op reads or writes
together and that lie side by side in one buffer let the fused backend use one GEMV for them
(a weight concatenated once at build time).

Ops (kind: fields):
  norm        src -> dst, weight prefix; kind "layer" (LayerNorm, weight + bias) or "rms"
  linear      src -> dsts[i] = act_i(src W_i^T + b_i), weights[i] prefixes, acts None/"gelu_tanh"
  attention   src (q|k|v of the row's new tokens) -> dst; state layer `layer`: rotary at the
              row's position, k/v written into the layer's cache, attention over the prefix
              and the causal text (decode: one query per row at its own position; prefill:
              the prompt's tokens of one row)
  residual    x += sum_i srcs[i] W_i^T + b_i (in list order)
  act_mul     dst = act(src0) * src1 (act "silu": SwiGLU)
  Hybrid (Gated DeltaNet / gated attention, Qwen 3.5; torch references in ops/gated_delta_net.py
  and ops/gated_attention.py):
  norm kind "rms_zc"   zero-centred RMSNorm x / rms(x) * (1 + w) (ops/rmsnorm_zero_centred.py)
  gated_norm  src (o, z) -> dst: per group of `size` channels w * o / rms(o) * silu(z)
  conv1d      src -> dst: depthwise causal conv + SiLU over the layer's "conv" state
  delta_rule  src (qkv, b, a) -> dst: q, k, v split, beta = sigmoid(b), decay from a (weights
              A_log, dt_bias), the gated delta rule over the layer's "recurrent" state (fp32)
  gated_attention  src (q|gate per head, k, v) -> dst: per-head q/k zero-centred RMSNorm
              (weights q_norm, k_norm), rotate-half (M-)RoPE at the row's position + its
              position offset, k/v into the layer's cache, causal GQA, times sigmoid(gate)
  Per-layer attention / embeddings (Gemma 4; models/gemma4/program.py):
  add         dst += src (a residual add of a buffer segment)
  scale       dst *= the tensor named weights[0] (its full name, e.g. a layer scalar)
  softcap     dst = cap * tanh(src / cap), params ("cap", value) (None: copy)
  per_layer_input  (x, tok) -> dsts (n per-layer segments of width P): per layer
              (RMSNorm_P(x W^T * dim^-0.5) * w_norm + tok_layer) * 2^-0.5; weights: the
              projection and its norm (ops/per_layer_input.py)
  window_attention (q, k, v) -> dst; params ("attn", LayerAttention): the layer's own heads,
              head size, RoPE, window, k/v source layer; q/k norms (weights q_norm, k_norm),
              scale-free v norm, rotate-half RoPE at the row's position, k/v written into
              the layer's state ("ring" or "kv" with its own shape) unless KV-shared, then
              attention over the source layer's state (fast/window_state_ops.py)
Recurrent state (conv, recurrent) is only updated for the step's active rows: a row that
rides along in a bucket keeps its state (k/v writes land on positions not yet valid).
Heads (`Head`): a short op list from `hidden` to logits, then a pick: argmax of `segments`
equal parts into columns `col`.. of the step's `out` [rows, 4] (the answer-marker rule of a
text phase applied when `mask_answer`). The step's feedback (`feedback`: what turns the
values sampled into the next input embedding) and the phase table come from the family's
skill protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Op:
    kind: str
    src: tuple[str, ...]
    dst: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    acts: tuple = ()
    layer: int = -1
    norm: str = "layer"
    eps: float = 1e-5
    size: int = 0            # gated_norm: channels per group (one head)
    params: tuple = ()       # per-op parameters: ((name, value), ...) (hashable values)

    def param(self, name: str, default=None):
        for k, v in self.params:
            if k == name:
                return v
        return default


def read_before_written(ops, seg: str) -> bool:
    """Some op of ops reads segment seg before any op writes it (seg is still live there: a
    lowering that would leave it unwritten must not apply)."""
    for op in ops:
        if seg in op.src:
            return True
        if seg in op.dst:
            return False
    return False


@dataclass(frozen=True)
class AttentionSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int            # rotated channels per head (partial rotary: < head_dim)
    theta: float = 10000.0
    mrope_section: tuple[int, ...] = ()   # gated_attention: M-RoPE sections (text rows equal)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention parameters (the window_attention op's "attn" param): its own
    head counts and head size, rotate-half RoPE (theta, rotated fraction of the pairs,
    frequency factor), `window` (sliding layers: keys within the last `window` positions) or
    None (global), `source` the layer whose state it reads (itself unless KV-shared),
    `writes` False for a KV-shared layer (it computes no k/v), `k_eq_v` (v is the raw k),
    the score scale."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float
    rotary_fraction: float = 1.0
    factor: float = 1.0
    window: int | None = None
    source: int = 0
    writes: bool = True
    k_eq_v: bool = False
    scale: float = 1.0

    @property
    def rope(self) -> tuple:
        """The rotary table's key: layers with equal keys share one table."""
        return (self.head_dim, self.theta, self.rotary_fraction, self.factor)


@dataclass(frozen=True)
class DeltaSpec:
    """The Gated DeltaNet layers' shapes (delta_rule ops)."""
    n_k_heads: int
    n_v_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class LayerState:
    """What one layer keeps per row between steps: "kv" (attention k/v, n_kv_heads x
    capacity x head_dim: the AttentionSpec's, or shape (n_kv_heads, head_dim) of its own),
    "ring" (a sliding layer's k/v in `window` slots, shape (n_kv_heads, window, head_dim):
    position p in slot p % window), or a fixed-size state of `shape`: "recurrent" (e.g. DeltaNet's
    [Hv, Dk, Dv]), "conv" (a causal conv's last inputs [C, K-1]). dtype None = the model's,
    "fp32" for states kept in fp32."""
    kind: str
    layer: int
    shape: tuple[int, ...] = ()
    dtype: str | None = None


@dataclass(frozen=True)
class Head:
    ops: tuple[Op, ...]
    logits: str             # the segment holding the logits after ops
    col: int                # first column of `out` written
    segments: int = 1
    mask_answer: bool = False


@dataclass(frozen=True)
class Feedback:
    """kind "token": wte[out[:, 0]]; "scaled_token": x = wte[id] * params "scale" (rounded to
    the table's dtype) and, with weights "extra" and params "extra_segment" / "extra_scale",
    that segment = extra[id] * extra_scale (Gemma 4: sqrt(hidden), the per-layer token part
    into "ple_tok"); "region": by phase, the token embedding or the
    coordinate / size encoder of the value sampled (ops/feedback_embedding.py), `by_phase[p]`
    naming what a step of phase p feeds back ("token" | "coord" | "size": the family's skill
    protocol). weights: name -> checkpoint tensor name."""
    kind: str
    weights: tuple[tuple[str, str], ...]
    by_phase: tuple[str, ...] = ()
    params: tuple = ()

    def param(self, name: str, default=None):
        return dict(self.params).get(name, default)

    def phase_of(self, value: str) -> int:
        """The one phase feeding back `value` (the region kernel takes it as an argument)."""
        ps = [p for p, v in enumerate(self.by_phase) if v == value]
        if len(ps) != 1:
            raise ValueError(f"feedback {self.kind!r}: {len(ps)} phases feed back {value!r}")
        return ps[0]


ATTENTION_STATES = ("kv", "ring")


@dataclass(frozen=True)
class Program:
    dim: int
    buffers: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    ops: tuple[Op, ...]
    attention: AttentionSpec
    state: tuple[LayerState, ...]
    heads: tuple[tuple[str, Head], ...]
    feedback: Feedback
    final_norm: str = ""     # (documentation) the norm the lm head applies to `hidden`
    vocab: int = 0
    delta: DeltaSpec | None = None

    def segment(self, name: str) -> tuple[str, int, int]:
        """-> (buffer, start column, width) of a segment."""
        for buf, segs in self.buffers:
            off = 0
            for n, w in segs:
                if n == name:
                    return buf, off, w
                off += w
        raise KeyError(f"no segment {name!r} in the program's buffers")

    def buffer_width(self, buf: str) -> int:
        return sum(w for n, w in dict(self.buffers)[buf])

    def head(self, name: str) -> Head:
        return dict(self.heads)[name]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.state if s.kind == "kv")

    @property
    def attention_states(self) -> tuple[LayerState, ...]:
        """The k/v states ("kv" and "ring"), in the program's order (PrefixState.kv's)."""
        return tuple(s for s in self.state if s.kind in ATTENTION_STATES)

    @property
    def row_states(self) -> tuple[LayerState, ...]:
        """The fixed-size (non-k/v) states, in the program's order."""
        return tuple(s for s in self.state if s.kind not in ATTENTION_STATES)


@dataclass
class ProgramBuilder:
    """Writes a Program op by op (the family's step_program uses it)."""
    ops: list = field(default_factory=list)

    def norm(self, src, dst, weight, kind="layer", eps=1e-5):
        self.ops.append(Op("norm", (src,), (dst,), (weight,), norm=kind, eps=eps))

    def linear(self, src, dsts, weights, acts=None):
        acts = tuple(acts) if acts is not None else (None,) * len(dsts)
        self.ops.append(Op("linear", (src,), tuple(dsts), tuple(weights), acts))

    def attention(self, src, dst, layer):
        self.ops.append(Op("attention", (src,), (dst,), layer=layer))

    def residual(self, srcs, weights, dst="x"):
        self.ops.append(Op("residual", tuple(srcs), (dst,), tuple(weights)))

    def act_mul(self, gate, up, dst, act="silu"):
        self.ops.append(Op("act_mul", (gate, up), (dst,), acts=(act,)))

    def gated_norm(self, src, gate, dst, weight, size, eps=1e-6):
        self.ops.append(Op("gated_norm", (src, gate), (dst,), (weight,), size=size, eps=eps))

    def conv1d(self, src, dst, weight, layer):
        self.ops.append(Op("conv1d", (src,), (dst,), (weight,), layer=layer))

    def delta_rule(self, qkv, b, a, dst, a_log, dt_bias, layer):
        self.ops.append(Op("delta_rule", (qkv, b, a), (dst,), (a_log, dt_bias), layer=layer))

    def gated_attention(self, qg, k, v, dst, q_norm, k_norm, layer, eps=1e-6):
        self.ops.append(Op("gated_attention", (qg, k, v), (dst,), (q_norm, k_norm),
                           layer=layer, eps=eps))

    def add(self, src, dst="x"):
        self.ops.append(Op("add", (src,), (dst,)))

    def scale(self, dst, tensor):
        self.ops.append(Op("scale", (dst,), (dst,), (tensor,)))

    def softcap(self, src, dst, cap):
        self.ops.append(Op("softcap", (src,), (dst,), params=(("cap", cap),)))

    def per_layer_input(self, x, tok, dsts, projection, norm, eps=1e-6):
        self.ops.append(Op("per_layer_input", (x, tok), tuple(dsts), (projection, norm),
                           norm="rms", eps=eps))

    def window_attention(self, q, k, v, dst, q_norm, k_norm, layer, attn: LayerAttention,
                         eps=1e-6):
        self.ops.append(Op("window_attention", (q, k, v), (dst,), (q_norm, k_norm),
                           layer=layer, norm="rms", eps=eps, params=(("attn", attn),)))

    def build(self) -> tuple[Op, ...]:
        return tuple(self.ops)


@dataclass
class StepSpec:
    """What the runtime needs of a family to run its decode steps: the program, the skill
    protocol's phase table (phase_next[phase][row kind]), the answer-marker rule of the lm
    head (rows in phase `answer_phase` never pick token `answer_id` after their first pick;
    None: no rule), the feedback's value tables (device tensors)."""
    program: Program
    phase_next: tuple[tuple[int, ...], ...]
    answer_id: int | None = None
    tables: dict = field(default_factory=dict)
    answer_phase: int = 0
