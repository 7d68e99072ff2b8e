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


@dataclass(frozen=True)
class AttentionSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int            # rotated channels per head (partial rotary: < head_dim)
    theta: float = 10000.0


@dataclass(frozen=True)
class LayerState:
    """What one layer keeps per row between steps: "kv" (attention k/v, n_kv_heads x
    capacity x head_dim) or "recurrent" (a fixed-size state of `shape`, e.g. DeltaNet's)."""
    kind: str
    layer: int
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Head:
    ops: tuple[Op, ...]
    logits: str             # the segment holding the logits after ops
    col: int                # first column of `out` written
    segments: int = 1
    mask_answer: bool = False


@dataclass(frozen=True)
class Feedback:
    """kind "token": wte[out[:, 0]]; "moondream_region": by phase, the token embedding or the
    coordinate / size encoder of the value sampled (ops/feedback_embedding.py). weights:
    name -> checkpoint tensor name."""
    kind: str
    weights: tuple[tuple[str, str], ...]


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

    def build(self) -> tuple[Op, ...]:
        return tuple(self.ops)


@dataclass
class StepSpec:
    """What the runtime needs of a family to run its decode steps: the program, the skill
    protocol's phase table (phase_next[phase][row kind]), the answer-marker token of the lm
    head's rule (None: no rule), the feedback's value tables (device tensors)."""
    program: Program
    phase_next: tuple[tuple[int, ...], ...]
    answer_id: int | None = None
    tables: dict = field(default_factory=dict)
