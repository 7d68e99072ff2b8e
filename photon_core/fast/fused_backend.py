"""The fused backend: runs a step program (program.py) with the Triton kernels of
photon_core/ops/, lowered once when the backend is built (weights concatenated, buffers laid
out, one launch per lowered op), for decode steps and short prompt prefills.

Lowering rules (Moondream 2's Phi block -> 5 launches per block):
  norm        -> the LayerNorm / RMSNorm kernel (fp32 residual x in, model dtype out)
  linear      -> one GEMV over the outputs' weights concatenated, when the outputs lie side
                 by side in one buffer (an optional gap between the plain part and ONE
                 gelu_tanh part at the end: the [qkv | gelu(fc1)] epilogue); else one GEMV
                 per output
  attention   -> decode: the decode_attention kernels (rotary + k/v write + split attention,
                 and the combine); prefill: the same kernels over the prompt's tokens of
                 one row (every token's k/v written first: decode_attention kv_row)
  residual    -> one split-K GEMV adding into the fp32 residual stream x, over the sources
                 when they are one contiguous K range (the weights concatenated along K, the
                 biases summed); else one GEMV per source
  act_mul     -> the op's torch reference (hybrid programs' "silu": ops/silu_gate.py, 1 launch)
  norm "rms_zc", gated_norm (Qwen 3.5) -> the rows kernels of ops/rmsnorm_zero_centred.py,
                 ops/rmsnorm_gated.py (strided buffer views in and out: one launch each)
  conv1d, delta_rule, gated_attention (the stateful hybrid ops of Qwen 3.5), decode: the
                 rows kernels (hybrid_rows.py: conv step 1 launch, delta rule step with its
                 gates 1, q/k norm + M-RoPE + k/v write 1, split gated attention + combine 2;
                 row states written only for active rows, positions / offsets / lengths
                 read on the device); prefill: the torch references (state_ops.py).
                 row_kernels=False: the torch references for decode too (the A/B baseline).
                 pdl=True: the norm, fused DeltaNet and attention kernels take a PDL launch
                 (hybrid_rows.py), the other rows kernels launch plainly; Gemma 4's
                 window attention kernels and sandwich norms take it too
  Per-layer attention programs (Gemma 4):
  window_attention -> fast/window_state_ops.py lower_fused: q|k per-head norm + rotary (one
                 launch, a weight per head), v's scale-free norm, the k/v slot write (one
                 launch), the rows' window attention kernel over a ring or the capacity
                 (decode); the torch chunk form for prompts
  norm + add (+ scale)  a sandwich norm `norm o -> h; add x += h` (and the layer scalar
                 `scale x` right after) -> one rmsnorm_residual kernel into the fp32 x, which
                 also writes an RMSNorm of x that follows it (NORM_CHAIN)
  linear + act_mul (EPILOGUE_FUSION) `linear h -> [gate, up]; act_mul -> m` (SwiGLU, Gemma's
                 GELU MLP) -> one GEMV over the (gate, up) row pairs writing m (EPI_GATED);
                 `linear s -> [p]; act_mul (p, q) -> m` (Gemma's per-layer input gate) -> one
                 GEMV writing act(p) * q (EPI_ACT_MUL): the same bits as the two launches
  add, scale  torch in place on x; softcap -> its kernel; act_mul gelu_tanh -> its kernel
  per_layer_input -> the projection's GEMV, then its torch tail (ops/per_layer_input.py)
  linear      reading the fp32 residual x: the GEMV rounds x as it loads it (no cast launch);
              whose K fits no GEMV tile (K % 16) -> torch's linear (counted: torch_linears)
Around the blocks: feedback (ops/feedback_embedding.py, or the token embedding), the row
advance by the phase table (ops/row_advance.py), the heads as GEMVs + masked argmax.
pdl (EngineOptions.pdl): the Triton kernels that take it (GEMVs, norms, attention, argmax,
row advance, feedback; the hybrid / window kernels named above) launch with programmatic
dependent launch (ops/pdl.py): each starts while the previous kernel finishes (a GEMV loads
its first weight tile meanwhile) and waits for it in-kernel; the torch ops and the other
kernels launch as before.
pdl_rows: only passes of at most that many rows (decode buckets, prompt tokens) do
(EngineOptions.pdl "auto": PDL_AUTO_ROWS); None: every pass.

For Moondream 2, per block: LN(x) -> GEMV [Wqkv; Wfc1] (+ GELU on the fc1 part) -> attention
-> combine -> split-K GEMV [Wproj, Wfc2] over u = [qkv | a | g]'s [a | g] into x.
Numerics differ from the reference path by the fp32 residual stream (the reference rounds x
to the model dtype after every block) and the summation order; the GPU bench diffs the
outputs against the torch step. The concatenated weights are copies, built once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import GEMV_MAX_ROWS
from ..ops.decode_attention import ROWS_CHUNK, AttentionScratch, decode_attention
from ..ops.eager import gated_norm_reference, norm_reference
from ..ops.feedback_embedding import feedback_embedding
from ..ops.gelu_tanh_gate import gelu_tanh_gate_triton
from ..ops.gated_activation import ACTIVATIONS
from ..ops.gemv import (EPI_ACT_MUL, EPI_GATED, EPI_QKV_GELU, EPI_RESIDUAL, EPI_STORE, gemv,
                        interleave_gated)
from ..ops.layernorm import layer_norm, rms_norm
from ..ops.logit_softcap import logit_softcap_triton
from ..ops.masked_argmax import masked_argmax
from ..ops.per_layer_input import per_layer_input_tail
from ..ops.rmsnorm_residual import rmsnorm_residual_triton
from ..ops.rope import rope_angles
from ..ops.row_advance import row_advance
from . import hybrid_rows, parallel_branch, state_ops, window_state_ops
from .eager_backend import ACTS, ScaledTokenFeedback, feedback_weights
from ..program import Op, read_before_written
from ..weight_layout import join_weights, joined_views

ATTN_CHUNK = 128     # measured on the H200: 7.3 us/layer at b=1 vs 8.1 (64), 9.3 (32)
# EngineOptions.pdl "auto": PDL for passes of at most this many rows, for the programs with
# hybrid or per-layer window attention ops (auto_pdl_rows). Decode step with / without PDL
# (bench/ab_switch.py, session 13 calls 4-5): Qwen 3.5 0.8B b=1 / 2 / 4 / 8 1.11 / 1.06 / 1.03 /
# 0.96x, Gemma 4 E2B 1.14 / 1.10 / 1.07 / 1.04x; Moondream 2 (plain attention) 1.02 / 0.97 /
# 0.95 / 1.00x: none there
PDL_AUTO_ROWS = 4


def auto_pdl_rows(program) -> int:
    """EngineOptions.pdl "auto"'s row limit for a step program (PDL_AUTO_ROWS; 0: none)."""
    helped = state_ops.uses_state_ops(program) or \
        window_state_ops.uses_window_attention(program)
    return PDL_AUTO_ROWS if helped else 0


# a pass's LayerNorm kernel and the GEMV right after it that reads its output take
# programmatic dependent launches where EngineOptions.pdl leaves the pass without them: the
# norm triggers its dependents as it starts, so the GEMV's programs are launched and load
# their first weight tile while it runs (ops/pdl.py). H200, Moondream 2's fused steps at
# position 760 (bench/ab_switch.py, session 38 call 4, three rounds): b = 1 / 2 / 4 / 8
# 0.9236 / 1.0117 / 1.1513 / 1.3095 vs 0.9468 / 1.0378 / 1.1740 / 1.3290 ms (1.03x / 1.03x /
# 1.02x / 1.01x; without its 25 LayerNorm launches at all the step would be ~70 us faster,
# call 3's bound). RMSNorm edges (Gemma 4's, measured 1.00x / 0.99x at b = 1 / 8 in the same
# call) are left as EngineOptions.pdl has them
NORM_PDL = True
# _lower_ops' patterns (False: the A/B baselines of bench/ab_switch.py, op by op as before)
NORM_CHAIN = True
EPILOGUE_FUSION = True
# the model's weights that a fused GEMV concatenates (rows, K columns, or gate / up row pairs)
# become views of the concatenated tensor (share_weights), so they are held once, not twice
SHARE_WEIGHTS = True


class FusedBackend:
    def __init__(self, spec, weights, kv, rows: int, attn_chunk: int = ATTN_CHUNK,
                 deterministic: bool = False, pdl: bool = False, row_kernels: bool = True,
                 pdl_rows: int | None = None, share_weights: bool = False):
        p = self.program = spec.program
        # programmatic dependent launch of every kernel (ops/pdl.py; EngineOptions.pdl), for
        # passes of at most pdl_rows rows (None: all)
        self.pdl, self.pdl_rows = pdl, pdl_rows
        self.spec, self.w, self.kv, self.rows = spec, weights, kv, rows
        # share_weights (with SHARE_WEIGHTS): the weights this backend joins become views of
        # the joined tensors in `weights` itself (their own tensors are freed): only where no
        # CUDA graph may read the old tensors yet (StepState: the first engine on a model)
        self.share_weights = share_weights and SHARE_WEIGHTS
        self.shared_bytes = 0
        dev, dt = kv.device, kv.dtype
        self.dtype = dt
        # no split-K GEMV (its fp32 atomics add in a varying order): bitwise repeatable steps
        self.deterministic = deterministic
        a = p.attention
        self.layer_slot = {layer: i for i, layer in enumerate(p.kv_layers)}
        self.cos, self.sin = (t.contiguous() for t in rope_angles(
            torch.arange(kv.capacity + 1, device=dev), a.rot_dim, a.theta))
        # buffers of one pass, for up to GEMV_MAX_ROWS rows: a decode step's bucket, or the
        # tokens of a short prompt (the prefill uses them too)
        n = max(rows, GEMV_MAX_ROWS)
        self.x = torch.zeros(n, p.dim, device=dev, dtype=torch.float32)
        self.bufs = {name: torch.zeros(n, p.buffer_width(name), device=dev, dtype=dt)
                     for name, _ in p.buffers}
        # (n rows: a decode bucket's, or a prompt's tokens: the prefill's attention kernels)
        self.scratch = AttentionScratch(n, a.n_heads, a.head_dim, kv.capacity, attn_chunk, dev,
                                        min_chunk=ROWS_CHUNK)
        self.feedback = feedback_weights(spec, weights)
        self.hybrid = state_ops.uses_state_ops(p)
        self.plain_attention = any(op.kind == "attention" for op in p.ops)
        self.row_ids = torch.arange(rows, device=dev)
        # the hybrid ops' rows kernels (Qwen 3.5): their tables, q and attention scratch
        self.rows_lowering = hybrid_rows.RowsLowering(self, rows) \
            if self.hybrid and row_kernels else None
        # op -> what its one fused GEMV runs (w, bias, out buffer, column, n_split, gap, epi,
        # in buffer, in column): other backends reuse these tensors (megakernel/lowering.py)
        self.fused_gemvs: dict[Op, dict] = {}
        # per-layer attention over the state cache's rings / own shapes (Gemma 4)
        self.window = window_state_ops.uses_window_attention(p)
        self.rotary = window_state_ops.RotaryTables(p, kv.capacity, dev, dt) \
            if self.window else None
        self.torch_linears: list = []     # linears without a GEMV tile (K % 16)
        self.fused_norm_adds = 0          # sandwich norms lowered with their add (+ scale)
        self.chained_norms = 0            # ... and with the RMSNorm after them
        self.gated_gemvs = 0              # linear + act_mul pairs as one GEMV
        self.fused_runs = 0               # hybrid runs of ops as one launch (hybrid_rows)
        self.beside_branches = 0          # gelu GEMVs on a second stream (parallel_branch)
        self.fork = None                  # its StreamFork (stream_fork)
        # norms and the GEMVs right after them, launched with PDL at every pass (NORM_PDL)
        self.norm_edges: set = set()
        for ops in (p.ops, *(h.ops for _, h in p.heads)):
            self._mark_norm_edges(ops)
        self.lowered = self._lower_ops(p.ops)
        self.heads = {name: ([self._lower(op) for op in h.ops], h) for name, h in p.heads}
        # a head's logits: as many as its last projection's outputs (ops after it, e.g. a
        # softcap, keep the width)
        self.head_width = {name: self.w[[op for op in h.ops if op.weights][-1].weights[0]
                                        + ".weight"].shape[0] for name, h in p.heads}

    def pdl_at(self, b: int, op: Op | None = None) -> bool:
        """PDL launches for a pass over b rows (read when its graph is captured); op: the op
        launching, whose norm edge (NORM_PDL) takes them at any b."""
        return (self.pdl and (self.pdl_rows is None or b <= self.pdl_rows)) or \
            (op is not None and op in self.norm_edges)

    def _mark_norm_edges(self, ops) -> None:
        """NORM_PDL: each LayerNorm (a `layer_norm` launch) directly followed by a linear
        reading its output: both into norm_edges."""
        if not NORM_PDL:
            return
        for a, c in zip(ops, ops[1:]):
            if (a.kind == "norm" and a.norm == "layer" and c.kind == "linear"
                    and c.src and c.src[0] == a.dst[0]):
                self.norm_edges.update((a, c))

    # -- lowering -------------------------------------------------------------------------
    def _view(self, seg: str, b: int) -> torch.Tensor:
        if seg == "x":
            return self.x[:b]
        buf, off, width = self.program.segment(seg)
        return self.bufs[buf][:b, off:off + width]

    def _src(self, seg: str, env: dict, b: int) -> torch.Tensor:
        return env[seg][:b] if seg in env else self._view(seg, b)

    def _contiguous(self, segs) -> tuple[str, int, int] | None:
        """(buffer, first column, total width) when the segments lie side by side, in order."""
        try:
            places = [self.program.segment(s) for s in segs]
        except KeyError:
            return None
        buf, off, _ = places[0]
        end = off
        for b2, o, w in places:
            if b2 != buf or o != end:
                return None
            end = o + w
        return buf, off, end - off

    def _weight(self, name: str):
        return self.w[name + ".weight"], self.w.get(name + ".bias")

    def _join(self, names, tensors: list[torch.Tensor], how: str) -> torch.Tensor:
        """join_weights; with share_weights the model's entries `names` (+ ".weight") then
        point at views of the joined tensor (the same values)."""
        joined = join_weights(tensors, how)
        if self.share_weights:
            for name, t, v in zip(names, tensors, joined_views(joined, [t.shape for t in tensors],
                                                               how)):
                if self.w[name + ".weight"] is t:
                    self.w[name + ".weight"] = v
                    self.shared_bytes += v.numel() * v.element_size()
        return joined

    def _lower_ops(self, ops) -> list:
        """Op by op, except these patterns (each one launch; module switches NORM_CHAIN,
        EPILOGUE_FUSION for the A/B of bench/ab_switch.py):
          a sandwich norm `norm o -> h; add x += h` (and a `scale x` right after) -> one
            rmsnorm_residual kernel into the fp32 x; with NORM_CHAIN, an RMSNorm of x right
            after it (`norm x -> h2`) is written by the same kernel;
          a Gated DeltaNet's conv1d -> delta_rule -> gated_norm -> one launch per decode
            step (hybrid_rows.RowsLowering.lower_run, FUSE_DELTA_NET);
          EPILOGUE_FUSION: `linear h -> [g, u]; act_mul (g, u) -> m` -> one GEMV over the
            (gate, up) row pairs whose epilogue writes m (EPI_GATED); `linear s -> [p];
            act_mul (p, q) -> m` -> one GEMV writing act(p) * q (EPI_ACT_MUL); when g / u /
            p are read by no later op."""
        out, i = [], 0
        while i < len(ops):
            op = ops[i]
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            run = self.rows_lowering.lower_run(ops, i) if self.rows_lowering else None
            if run is not None:             # a hybrid layer's stateful run (hybrid_rows.py)
                out.append(run[0])
                self.fused_runs += 1
                i += run[1]
                continue
            if (op.kind == "norm" and op.norm == "rms" and nxt is not None
                    and nxt.kind == "add" and nxt.src == op.dst and nxt.dst == ("x",)):
                after = ops[i + 2] if i + 2 < len(ops) else None
                scaled = after is not None and after.kind == "scale" and after.dst == ("x",)
                i += 3 if scaled else 2
                chain = ops[i] if NORM_CHAIN and i < len(ops) else None
                if not (chain is not None and chain.kind == "norm" and chain.norm == "rms"
                        and chain.src == ("x",)):
                    chain = None
                wt = self.w[op.weights[0] + ".weight"].contiguous()
                sc = self.w[after.weights[0]].float() if scaled else None
                w2 = self.w[chain.weights[0] + ".weight"].contiguous() if chain else None
                out.append(lambda b, env, op=op, wt=wt, sc=sc, chain=chain, w2=w2:
                           rmsnorm_residual_triton(
                               self._src(op.src[0], env, b), wt, self.x[:b], op.eps, sc,
                               next_weight=w2, h=self._view(chain.dst[0], b) if chain else None,
                               next_eps=chain.eps if chain else 1e-6, pdl=self.pdl_at(b)))
                self.fused_norm_adds += 1
                if chain is not None:
                    self.chained_norms += 1
                    i += 1
                continue
            f = self._lower_gated(op, nxt, ops[i + 2:]) if EPILOGUE_FUSION else None
            if f is not None:
                out.append(f)
                self.gated_gemvs += 1
                i += 2
                continue
            f = self._lower(op)
            beside = parallel_branch.lower_beside(self, ops, i, f)
            if beside is not None:          # the gelu part on a second stream
                out.extend(beside[0])
                self.beside_branches += 1
                i += beside[1]
                continue
            out.append(f)
            i += 1
        return out

    def stream_fork(self) -> "parallel_branch.StreamFork":
        """The backend's second stream (parallel_branch.py), made once."""
        if self.fork is None:
            self.fork = parallel_branch.StreamFork(self.x.device)
        return self.fork

    def _lower_gated(self, op: Op, nxt: Op | None, rest):
        """The linear + act_mul pair as one GEMV with a gated epilogue (_lower_ops), or None
        where the pattern does not apply."""
        if not (op.kind == "linear" and nxt is not None and nxt.kind == "act_mul"
                and all(a is None for a in op.acts) and nxt.src[0] == op.dst[0]
                and nxt.acts[0] in ACTIVATIONS):
            return None
        gated = len(op.dst) == 2 and tuple(nxt.src) == tuple(op.dst)
        act_mul = len(op.dst) == 1 and nxt.src[1] not in op.dst
        if not (gated or act_mul) or any(read_before_written(rest, d) for d in op.dst):
            return None
        ws = [self._weight(n) for n in op.weights]
        n = ws[0][0].shape[0]
        if ws[0][0].shape[1] % 16 or any((bb is None) != (ws[0][1] is None) for _, bb in ws):
            return None
        if any(t.shape != ws[0][0].shape for t, _ in ws) or \
                self.program.segment(nxt.src[1])[2] != n:
            return None                 # gate / up (or the multiplier) of another width
        src, act, dst = op.src[0], nxt.acts[0], nxt.dst[0]
        buf, off, _ = self.program.segment(dst)
        if gated:
            w = self._join(op.weights, [ws[0][0], ws[1][0]], "pairs")
            bias = None if ws[0][1] is None else interleave_gated(ws[0][1], ws[1][1])
            self.fused_gemvs[op] = dict(w=w, bias=bias, buf=buf, off=off, n_split=0, gap=0,
                                        epi=EPI_GATED, src=src, act=act)
            return lambda b, env: gemv(self._src(src, env, b), w, bias,
                                       self.bufs[buf][:b, off:], EPI_GATED, act=act,
                                       pdl=self.pdl_at(b))
        w, bias = ws[0][0].contiguous(), ws[0][1]
        q = nxt.src[1]
        self.fused_gemvs[op] = dict(w=w, bias=bias, buf=buf, off=off, n_split=0, gap=0,
                                    epi=EPI_ACT_MUL, src=src, act=act, mul=q)
        return lambda b, env: gemv(self._src(src, env, b), w, bias, self.bufs[buf][:b, off:],
                                   EPI_ACT_MUL, act=act, mul=self._src(q, env, b),
                                   pdl=self.pdl_at(b))

    def _lower(self, op: Op):
        k = op.kind
        if self.rows_lowering is not None:
            f = self.rows_lowering.lower(op)
            if f is not None:
                return f
        if k == "norm" and op.norm not in ("layer", "rms"):        # no kernel yet
            src, dst = op.src[0], op.dst[0]
            return lambda b, env: self._view(dst, b).copy_(
                norm_reference(op, self._src(src, env, b), self.w))
        if k == "gated_norm":
            (o, z), dst = op.src, op.dst[0]
            return lambda b, env: self._view(dst, b).copy_(
                gated_norm_reference(op, self._view(o, b), self._view(z, b), self.w))
        if k in state_ops.KINDS:
            srcs, dst = op.src, op.dst[0]
            return lambda b, env: self._view(dst, b).copy_(
                env["stateful"][k](op, [self._src(s, env, b) for s in srcs]))
        if k == "norm":
            wt, bias = self._weight(op.weights[0])
            wt = wt.contiguous()
            src, dst, eps = op.src[0], op.dst[0], op.eps
            if op.norm == "layer":
                bias = bias.contiguous()
                return lambda b, env: layer_norm(self._src(src, env, b), wt, bias,
                                                 self._view(dst, b), eps,
                                                 pdl=self.pdl_at(b, op))
            return lambda b, env: rms_norm(self._src(src, env, b), wt, self._view(dst, b), eps,
                                           pdl=self.pdl_at(b, op))
        if k == "linear":
            return self._lower_linear(op)
        if k == "attention":
            slot = self.layer_slot[op.layer]
            src, dst = op.src[0], op.dst[0]
            return lambda b, env: env["attend"](slot, self._view(src, b), self._view(dst, b))
        if k == "residual":
            return self._lower_residual(op)
        if k == "act_mul" and op.acts[0] == "gelu_tanh":
            (g, u), dst = op.src, op.dst[0]
            return lambda b, env: gelu_tanh_gate_triton(self._view(g, b), self._view(u, b),
                                                        out=self._view(dst, b))
        if k == "act_mul":
            act = ACTS[op.acts[0]]
            (g, u), dst = op.src, op.dst[0]
            return lambda b, env: self._view(dst, b).copy_(
                act(self._view(g, b)) * self._view(u, b))
        if k == "window_attention":
            return window_state_ops.lower_fused(self, op)
        if k == "add":
            src, dst = op.src[0], op.dst[0]
            return lambda b, env: self._view(dst, b).add_(self._src(src, env, b))
        if k == "scale":
            sc = self.w[op.weights[0]].float()
            return lambda b, env: self._view(op.dst[0], b).mul_(sc)
        if k == "softcap":
            cap, src, dst = op.param("cap"), op.src[0], op.dst[0]
            return lambda b, env: logit_softcap_triton(self._view(src, b), cap,
                                                       out=self._view(dst, b))
        if k == "per_layer_input":
            return self._lower_per_layer_input(op)
        raise ValueError(f"the fused backend has no lowering for op {k!r}")

    def _lower_per_layer_input(self, op: Op):
        (x, tok), n = op.src, len(op.dst)
        place = self._contiguous(op.dst)
        if place is None:
            raise ValueError("per_layer_input: its segments must lie side by side")
        buf, off, width = place
        wp = self.w[op.weights[0] + ".weight"].contiguous()
        wn = self.w[op.weights[1] + ".weight"].contiguous()
        dim = self.program.dim

        def run(b, env):
            out = self.bufs[buf][:b, off:off + width]
            gemv(self._src(x, env, b), wp, None, out, EPI_STORE, pdl=self.pdl_at(b))
            out.copy_(per_layer_input_tail(out, self._src(tok, env, b), wn, n, width // n,
                                           dim, op.eps))
        return run

    def _lower_linear(self, op: Op):
        src, acts = op.src[0], list(op.acts)
        ws = [self._weight(n) for n in op.weights]
        if src == "x" or ws[0][0].shape[1] % 16:
            return self._lower_linear_plain(op, ws)
        n_plain = next((i for i, a in enumerate(acts) if a is not None), len(acts))
        plain = self._contiguous(op.dst[:n_plain]) if n_plain else None
        gelu_last = acts[n_plain:] == ["gelu_tanh"]
        one_bias = all(bb is not None for _, bb in ws) or all(bb is None for _, bb in ws)
        if one_bias and (n_plain == len(acts) and plain is not None or gelu_last):
            gbuf, goff, _ = self.program.segment(op.dst[-1]) if gelu_last else (None, 0, 0)
            if n_plain == 0:                    # one gelu output
                buf, off, n_split, gap = gbuf, goff, 0, 0
            elif plain is not None and (not gelu_last or (
                    gbuf == plain[0] and goff >= plain[1] + plain[2])):
                buf, off, n_split = plain
                gap = goff - (off + n_split) if gelu_last else 0
            else:
                buf = None
            if buf is not None:
                w = self._join(op.weights, [t for t, _ in ws], "rows") if len(ws) > 1 \
                    else ws[0][0].contiguous()
                bias = torch.cat([bb for _, bb in ws]) if ws[0][1] is not None else None
                epi = EPI_QKV_GELU if gelu_last else EPI_STORE
                self.fused_gemvs[op] = dict(w=w, bias=bias, buf=buf, off=off, n_split=n_split,
                                            gap=gap, epi=epi, src=src)
                return lambda b, env: gemv(self._src(src, env, b), w, bias,
                                           self.bufs[buf][:b, off:], epi, n_split=n_split,
                                           gap=gap, pdl=self.pdl_at(b, op))
        parts = []                              # one output at a time
        for d, (t, bb), act in zip(op.dst, ws, acts):
            buf, off, _ = self.program.segment(d)
            t = t.contiguous()
            if act in (None, "gelu_tanh"):
                epi = EPI_STORE if act is None else EPI_QKV_GELU
                parts.append(lambda b, env, t=t, bb=bb, buf=buf, off=off, epi=epi: gemv(
                    self._src(src, env, b), t, bb, self.bufs[buf][:b, off:], epi,
                    pdl=self.pdl_at(b)))
            else:                               # no kernel epilogue: the torch op
                parts.append(lambda b, env, t=t, bb=bb, d=d, act=ACTS[act]: self._view(
                    d, b).copy_(act(F.linear(self._src(src, env, b), t, bb))))

        def run(b, env):
            for f in parts:
                f(b, env)
        return run

    def _lower_linear_plain(self, op: Op, ws):
        """A linear reading the fp32 residual x (cast to the model dtype), or whose K fits no
        GEMV tile (torch's linear, counted in torch_linears): one output at a time."""
        src, dt = op.src[0], self.dtype
        cast = None if EPILOGUE_FUSION else dt
        parts = []
        for d, (t, bb), act in zip(op.dst, ws, op.acts):
            buf, off, width = self.program.segment(d)
            t = t.contiguous()
            if t.shape[1] % 16 == 0 and act is None:
                # the GEMV rounds the fp32 x to the weights' dtype as it loads it (the
                # baseline of EPILOGUE_FUSION: a cast launch first)
                parts.append(lambda b, env, t=t, bb=bb, buf=buf, off=off, cast=cast: gemv(
                    self._src(src, env, b).to(cast) if cast else self._src(src, env, b), t,
                    bb, self.bufs[buf][:b, off:], EPI_STORE, pdl=self.pdl_at(b)))
            else:
                self.torch_linears.append(op.weights)
                parts.append(lambda b, env, t=t, bb=bb, d=d, act=ACTS[act]: self._view(
                    d, b).copy_(act(F.linear(self._src(src, env, b).to(dt), t, bb))))

        def run(b, env):
            for f in parts:
                f(b, env)
        return run

    def _lower_residual(self, op: Op):
        ws = [self._weight(n) for n in op.weights]
        place = self._contiguous(op.src)
        biases = [bb for _, bb in ws if bb is not None]
        if place is not None:
            w = self._join(op.weights, [t for t, _ in ws], "cols") if len(ws) > 1 \
                else ws[0][0].contiguous()
            bias = None
            if biases:
                bias = biases[0].float()
                for bb in biases[1:]:
                    bias = bias + bb.float()
            buf, off, width = place
            self.fused_gemvs[op] = dict(w=w, bias=bias, buf="x", off=0, n_split=0, gap=0,
                                        epi=EPI_RESIDUAL, src_buf=buf, src_off=off)
            return lambda b, env: gemv(self.bufs[buf][:b, off:off + width], w, bias,
                                       self.x[:b], EPI_RESIDUAL,
                                       deterministic=self.deterministic, pdl=self.pdl_at(b))
        parts = []
        for s, (t, bb) in zip(op.src, ws):
            t = t.contiguous()
            parts.append(lambda b, env, s=s, t=t, bb=bb: gemv(
                self._view(s, b), t, None if bb is None else bb.float(), self.x[:b],
                EPI_RESIDUAL, deterministic=self.deterministic, pdl=self.pdl_at(b)))

        def run(b, env):
            for f in parts:
                f(b, env)
        return run

    # -- a decode step ------------------------------------------------------------------
    def decoder(self, pos: torch.Tensor, b: int, offset: torch.Tensor | None = None,
                active: torch.Tensor | None = None, attn_len: int | None = None
                ) -> torch.Tensor:
        """self.x[:b] (the rows' input embeddings, fp32) at positions pos [b] through the
        program (k/v into the state cache; hybrid ops: rotary at pos + offset, row states of
        the active rows); returns the fp32 residual stream [b, dim]."""
        a, kv = self.program.attention, self.kv

        def attend(slot, qkv, out):
            decode_attention(qkv, pos, self.cos, self.sin, kv.data[slot, 0], kv.data[slot, 1],
                             out, self.scratch, a.n_heads, a.n_kv_heads, a.head_dim,
                             pdl=self.pdl_at(b), ordered=self.deterministic)
        env = {"attend": attend}
        if self.window:
            env["window"] = ("decode", self.row_ids[:b], pos.clamp(max=kv.capacity - 1),
                             attn_len or kv.capacity)
        if self.rows_lowering is not None:
            env["rows"] = self.rows_lowering.step(pos, offset, active, attn_len or kv.capacity)
        elif self.hybrid:
            env["stateful"] = state_ops.decode_ops(
                self.program, self.w, kv, self.row_ids[:b], pos,
                offset if offset is not None else torch.zeros_like(pos), active,
                attn_len or kv.capacity)
        for f in self.lowered:
            f(b, env)
        return self.x[:b]

    def feed(self, st, b: int) -> None:
        """GPU-resident feedback: each row's next input embedding into the residual x."""
        if self.program.feedback.kind == "region":
            feedback_embedding(self.feedback, st.out[:b], st.phase[:b], self.x[:b],
                               pdl=self.pdl_at(b))
        elif isinstance(self.feedback, ScaledTokenFeedback):
            self._inputs(self.feedback.embed(st.out[:b, 0]), b)
        else:
            self.x[:b].copy_(F.embedding(st.out[:b, 0], self.feedback))

    def forward(self, st, b: int, attn_len: int) -> None:
        self.feed(st, b)
        self.decoder(st.pos[:b], b, st.pos_offset[:b], st.active[:b], attn_len)
        row_advance(self.x[:b], st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                    st.kind[:b], st.first[:b], st.phase_next, pdl=self.pdl_at(b))

    def head_logits(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """A head's logits [b, n] (a view of a buffer) from hidden [b, dim]."""
        fns, h = self.heads[name]
        b = hidden.shape[0]
        env = {"hidden": hidden}
        for f in fns:
            f(b, env)
        return self._view(h.logits, b)[:, :self.head_width[name]]

    def head_pick(self, name: str, st, b: int) -> None:
        h = self.program.head(name)
        logits = self.head_logits(name, st.hidden[:b])
        if h.mask_answer and self.spec.answer_id is not None:
            masked_argmax(logits, st.out, h.col, mask_col=self.spec.answer_id,
                          phase=st.phase[:b], first=st.first[:b],
                          mask_phase=self.spec.answer_phase, pdl=self.pdl_at(b))
        else:
            masked_argmax(logits, st.out, h.col, segments=h.segments, pdl=self.pdl_at(b))

    # -- a prompt prefill (T <= GEMV_MAX_ROWS tokens) into one row --------------------------
    def _inputs(self, inputs: dict, b: int) -> None:
        """The program's inputs (embed_ids / the feedback's) into x and their segments."""
        for name, t in inputs.items():
            (self.x[:b] if name == "x" else self._view(name, b)).copy_(t)

    def prefill(self, x: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, offset=None,
                n_valid: torch.Tensor | None = None, extra: dict | None = None
                ) -> torch.Tensor:
        """x [T, dim] at positions pos [T] of row `row`: the GEMVs over the T token rows,
        attention with the decode attention kernels in their prefill form; returns the fp32 residual [T, dim]
        (offset, n_valid: as the eager backend's prefill)."""
        a, kv = self.program.attention, self.kv
        T = x.shape[0]
        env = {}
        if self.plain_attention:
            def attend(slot, qkv, out):
                decode_attention(qkv, pos, self.cos, self.sin, kv.data[slot, 0],
                                 kv.data[slot, 1], out, self.scratch, a.n_heads, a.n_kv_heads,
                                 a.head_dim, pdl=self.pdl_at(T), kv_row=row,
                                 ordered=self.deterministic)
            env["attend"] = attend
        if self.hybrid:
            env["stateful"] = state_ops.prefill_ops(self.program, self.w, kv, row, pos,
                                                    0 if offset is None else offset, n_valid)
        if self.window:
            env["window"] = ("prefill", row, pos, n_valid, {})
        self.x[:T].copy_(x)
        if extra:
            self._inputs(extra, T)
        for f in self.lowered:
            f(T, env)
        return self.x[:T]
