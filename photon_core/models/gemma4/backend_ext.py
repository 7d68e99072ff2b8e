"""A LOCAL EXTENSION of the runtime for Gemma 4's step program (program.py), until the
runtime (photon_core/program.py, fast/eager_backend.py, fast/fused_backend.py,
fast/static_kv_cache.py) is model-agnostic: the state cache with per-layer shapes and rings,
and the eager and fused executors of the op kinds program.py does not have yet (add, scale,
per_layer_input, window_attention, softcap; feedback "gemma_token"). The executors keep the
runtime backends' interface (`forward(st, b, attn_len)`, `head_logits`, `head_pick`,
`prefill`), so decode_step.py's pieces (lm_greedy, forward) drive them unchanged. To be folded
into program.py and the backends (docs/gemma4.md says how); nothing here is Gemma-only
except the op kinds' parameters.

State: state_cache.py (per-layer k/v with the layer's own shape; sliding layers as rings).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.eager import run_ops
from ...ops.layernorm import rms_norm
from ...ops.masked_argmax import masked_argmax, masked_argmax_reference
from ...ops.rmsnorm_scaled import rmsnorm_scaled
from ...ops.rotary_half import apply_rotary_half, cos_sin, inv_freq, norm_rotary_triton
from ...ops.row_advance import row_advance, row_advance_reference
from ...ops.sliding_window_attention import (prefill_attention, prefill_keys,
                                             rows_decode_reference, rows_decode_triton,
                                             state_slot)
from ...ops.logit_softcap import logit_softcap, logit_softcap_triton
from ...ops.gelu_tanh_gate import gelu_tanh_gate_triton
from .state_cache import Gemma4StateCache
from ...ops.rmsnorm_residual import rmsnorm_residual_triton


class _Common:
    """What both executors share: rotary tables per layer type, the token feedback."""

    def __init__(self, spec, weights, kv: Gemma4StateCache):
        self.spec, self.program, self.w, self.kv = spec, spec.program, weights, kv
        p = self.program
        emb = weights[dict(p.feedback.weights)["wte"]]
        dev, dt = emb.device, emb.dtype
        self.dev, self.dt = dev, dt
        self.wte = emb
        # the per-layer embedding table: on the model's device, or in host memory
        # (load_model(ple_on_cpu=True): E2B's is 4.7 GB): gathered there, rows moved over
        self.wte_pl = weights[dict(p.feedback.weights)["wte_pl"]] if p.ple_dim else None
        # the scales rounded to the dtype, as the reference; on the devices they multiply on
        self.embed_scale = torch.tensor(p.dim ** 0.5, dtype=dt, device=dev)
        self.ple_scale = (torch.tensor(p.ple_dim ** 0.5, dtype=self.wte_pl.dtype,
                                       device=self.wte_pl.device) if p.ple_dim else None)
        positions = torch.arange(kv.capacity + 1, device=dev)
        self.rot = {}
        for la in p.layers:
            key = (la.head_dim, la.theta, la.rotary_fraction, la.factor)
            if key not in self.rot:
                f = inv_freq(la.head_dim, la.theta, la.rotary_fraction, la.factor)
                self.rot[key] = tuple(t.contiguous() for t in cos_sin(positions, f, dt))

    def rot_of(self, la):
        return self.rot[(la.head_dim, la.theta, la.rotary_fraction, la.factor)]

    def embed(self, ids: torch.Tensor):
        """ids [n] -> x [n, dim] (embed * sqrt(dim), the scale rounded to the dtype, as the
        reference) and the per-layer token part [n, L * P] (or None)."""
        x = self.wte[ids] * self.embed_scale
        if self.wte_pl is None:
            return x, None
        t = self.wte_pl
        tok = (t[ids.to(t.device)] * self.ple_scale).to(self.dev, non_blocking=True)
        return x, tok


def _per_layer_input(x, tok, w, op, L, P, eps):
    """The op's reference: (RMSNorm_P(x W^T * dim^-0.5) * w_norm + tok) * 2^-0.5 -> [n, L*P]."""
    proj, norm = op.weights
    ctx = F.linear(x, w[proj + ".weight"]) * x.shape[-1] ** -0.5
    ctx = rmsnorm_scaled(ctx.view(-1, L, P), w[norm + ".weight"], eps)
    return ((ctx + tok.view(-1, L, P)) * 2.0 ** -0.5).view(-1, L * P)


class EagerGemma4Backend(_Common):
    """Each op's torch reference, in the program's order (fp32: the reference engine's
    results up to the summation order of the ring's keys)."""

    def run(self, ops, env: dict, attend=None) -> dict:
        p, w = self.program, self.w
        for op in ops:
            k = op.kind
            if k == "add":
                env[op.dst[0]] = env[op.dst[0]] + env[op.src[0]]
            elif k == "scale":
                env[op.dst[0]] = env[op.src[0]] * w[op.weights[0]]
            elif k == "softcap":
                env[op.dst[0]] = logit_softcap(env[op.src[0]], p.softcap)
            elif k == "per_layer_input":
                ple = _per_layer_input(env["x"], env["ple_tok"], w, op, p.n_layers,
                                       p.ple_dim, op.eps)
                for i, d in enumerate(op.dst):
                    env[d] = ple[:, i * p.ple_dim:(i + 1) * p.ple_dim]
            elif k == "window_attention":
                env[op.dst[0]] = attend(op, env)
            else:
                run_ops((op,), env, w)
        return env

    def _qkv(self, op, env, pos):
        """q [n, Hq, D] normed + rotated; k, v [n, Hkv, D] (None on KV-shared layers)."""
        la = self.program.layers[op.layer]
        cos, sin = (t[pos] for t in self.rot_of(la))
        n, D = pos.shape[0], la.head_dim
        q = env[op.src[0]].reshape(n, la.n_heads, D)
        q = apply_rotary_half(rmsnorm_scaled(q, self.w[op.weights[0] + ".weight"], op.eps),
                              cos, sin)
        if not la.writes:
            return la, q, None, None
        k_raw = env[op.src[1]].reshape(n, la.n_kv_heads, D)
        v_raw = k_raw if la.k_eq_v else env[op.src[2]].reshape(n, la.n_kv_heads, D)
        k = apply_rotary_half(rmsnorm_scaled(k_raw, self.w[op.weights[1] + ".weight"], op.eps),
                              cos, sin)
        return la, q, k, rmsnorm_scaled(v_raw, None, op.eps)

    # -- a decode step ------------------------------------------------------------------
    def decoder(self, x, ple_tok, pos, rows, attn_len):
        kv = self.kv

        def attend(op, env):
            la, q, k, v = self._qkv(op, env, pos)
            src = la.source
            ring = kv.ring[src]
            if k is not None:
                slot = state_slot(pos, kv.k[src].shape[2], ring)
                kv.k[src][rows, :, slot] = k
                kv.v[src][rows, :, slot] = v
            a = rows_decode_reference(q, kv.k[src], kv.v[src], rows, pos, la.window, ring,
                                      la.scale, attn_len)
            return a.reshape(a.shape[0], -1)
        return self.run(self.program.ops, {"x": x, "ple_tok": ple_tok}, attend)["x"]

    def forward(self, st, b: int, attn_len: int) -> None:
        x, tok = self.embed(st.out[:b, 0])
        pos = st.pos[:b]
        hidden = self.decoder(x, tok, pos.clamp(max=self.kv.capacity - 1), st.row_ids[:b],
                              attn_len)
        row_advance_reference(hidden, st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                              st.kind[:b], st.first[:b], st.phase_next)

    def head_logits(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        h = self.program.head(name)
        return self.run(h.ops, {"hidden": hidden})[h.logits]

    def head_pick(self, name: str, st, b: int) -> None:
        h = self.program.head(name)
        masked_argmax_reference(self.head_logits(name, st.hidden[:b]), st.out, h.col,
                                h.segments)

    # -- a prompt prefill into one row ----------------------------------------------------
    def prefill(self, ids: torch.Tensor, row: int, start: int) -> torch.Tensor:
        """ids [T] at positions start.. of `row` -> the hidden states [T, dim]."""
        kv = self.kv
        pos = start + torch.arange(ids.shape[0], device=ids.device)
        views = {}

        def attend(op, env):
            la, q, k, v = self._qkv(op, env, pos)
            src = la.source
            if k is not None:
                views[src] = prefill_keys(k, v, kv.k[src][row], kv.v[src][row], start,
                                          kv.ring[src])
            a = prefill_attention(q, *views[src], start, la.window, la.scale)
            return a.reshape(a.shape[0], -1)
        x, tok = self.embed(ids)
        return self.run(self.program.ops, {"x": x, "ple_tok": tok}, attend)["x"]


class FusedGemma4Backend(_Common):
    """The Triton kernels where the ops have them: RMSNorm rows (layernorm.py), GEMVs
    (gemv.py; outputs side by side -> one GEMV over the concatenated weights), per-head
    norm + rotary (rotary_half.py), the rows' window attention (sliding_window_attention.py),
    gelu_tanh gate, softcap, masked argmax, row advance; a sandwich norm with its residual
    add and the layer scalar after it is one kernel (rmsnorm_residual.py). Torch for what has
    no kernel yet: the k/v index write, the per-layer input's elementwise tail, linears whose
    K fits no GEMV tile. Residual stream x in fp32 (as the fused backend). Decode steps of up to
    GEMV_MAX_ROWS rows and prefills of up to that many tokens (attention: the reference's
    prefill form)."""

    def __init__(self, spec, weights, kv, rows: int):
        super().__init__(spec, weights, kv)
        from ...ops import GEMV_MAX_ROWS
        p = self.program
        n = max(rows, GEMV_MAX_ROWS)
        self.max_rows = n
        self.x = torch.zeros(n, p.dim, device=self.dev, dtype=torch.float32)
        self.bufs = {name: torch.zeros(n, p.buffer_width(name), device=self.dev, dtype=self.dt)
                     for name, _ in p.buffers}
        self.torch_linears: list = []     # linears without a GEMV tile (see _gemv)
        self.fused_norm_adds = 0          # sandwich norms lowered with their add (_lower_all)
        self.lowered = self._lower_all(p.ops)
        self.heads = {name: [self._lower(op) for op in h.ops] for name, h in p.heads}

    def _view(self, seg: str, b: int) -> torch.Tensor:
        if seg == "x":
            return self.x[:b]
        buf, off, width = self.program.segment(seg)
        return self.bufs[buf][:b, off:off + width]

    def _src(self, seg, env, b):
        return env[seg][:b] if seg in env else self._view(seg, b)

    def _lower_all(self, ops) -> list:
        """Lower op by op, except a sandwich norm: `norm o -> h; add x += h` (and the layer's
        `scale x` right after) -> one rmsnorm_residual kernel into the fp32 x."""
        out, i = [], 0
        while i < len(ops):
            op = ops[i]
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            if (op.kind == "norm" and nxt is not None and nxt.kind == "add"
                    and nxt.src == op.dst and nxt.dst == ("x",)):
                after = ops[i + 2] if i + 2 < len(ops) else None
                scaled = after is not None and after.kind == "scale" and after.dst == ("x",)
                wt = self.w[op.weights[0] + ".weight"].contiguous()
                sc = self.w[after.weights[0]].float() if scaled else None
                out.append(lambda b, env, op=op, wt=wt, sc=sc: rmsnorm_residual_triton(
                    self._src(op.src[0], env, b), wt, self.x[:b], op.eps, sc))
                self.fused_norm_adds += 1
                i += 3 if scaled else 2
                continue
            out.append(self._lower(op))
            i += 1
        return out

    def _lower(self, op):
        from ...ops.gemv import EPI_STORE, gemv
        p, w, k = self.program, self.w, op.kind
        if k == "norm":
            wt = w[op.weights[0] + ".weight"].contiguous()
            return lambda b, env: rms_norm(self._src(op.src[0], env, b), wt,
                                           self._view(op.dst[0], b), op.eps)
        if k == "linear":
            places = [p.segment(d) for d in op.dst]
            side = all(pl[0] == places[0][0] and pl[1] == places[0][1] + sum(
                q[2] for q in places[:j]) for j, pl in enumerate(places))
            ws = [w[n + ".weight"] for n in op.weights]
            if side:              # one GEMV over the outputs' weights concatenated
                wt = torch.cat(ws).contiguous() if len(ws) > 1 else ws[0].contiguous()
                buf, off, _ = places[0]
                parts = [(wt, lambda b, buf=buf, off=off, n=wt.shape[0]:
                          self.bufs[buf][:b, off:off + n])]
            else:
                parts = [(t.contiguous(), lambda b, d=d: self._view(d, b))
                         for d, t in zip(op.dst, ws)]
            fns = [self._gemv(op, t, out) for t, out in parts]
            return lambda b, env: [f(b, env) for f in fns]
        if k == "act_mul":
            assert op.acts[0] == "gelu_tanh"
            return lambda b, env: gelu_tanh_gate_triton(self._src(op.src[0], env, b),
                                                        self._src(op.src[1], env, b),
                                                        out=self._view(op.dst[0], b))
        if k == "add":
            return lambda b, env: self._view(op.dst[0], b).add_(self._view(op.src[0], b))
        if k == "scale":
            s = w[op.weights[0]].float()
            return lambda b, env: self._view(op.dst[0], b).mul_(s)
        if k == "softcap":
            return lambda b, env: logit_softcap_triton(self._view(op.src[0], b), p.softcap,
                                                       out=self._view(op.dst[0], b))
        if k == "per_layer_input":
            proj, norm = op.weights
            wp = w[proj + ".weight"].contiguous()
            wn = w[norm + ".weight"].contiguous()
            L, P = p.n_layers, p.ple_dim
            buf, off, _ = p.segment(op.dst[0])

            def run(b, env):
                out = self.bufs[buf][:b, off:off + L * P]
                gemv(self.x[:b].to(self.dt), wp, None, out, EPI_STORE)
                out.mul_(p.dim ** -0.5)
                ctx = rms_norm(out.reshape(b * L, P), wn, torch.empty(b * L, P, device=self.dev,
                                                                     dtype=self.dt), op.eps)
                out.copy_((ctx.view(b, L * P) + self._view("ple_tok", b)) * 2.0 ** -0.5)
            return run
        if k == "window_attention":
            return self._lower_attention(op)
        raise ValueError(f"no fused lowering for op {k!r}")

    def _gemv(self, op, wt, out):
        """y = src W^T with the GEMV kernel; K not a multiple of 16 (no GEMV tile fits: the
        tiny test model's per-layer width 8) -> torch's linear, counted in torch_linears."""
        from ...ops.gemv import EPI_STORE, gemv
        src = op.src[0]
        if wt.shape[1] % 16:
            self.torch_linears.append(op.weights)
            return lambda b, env: out(b).copy_(F.linear(self._src(src, env, b).to(self.dt), wt))
        return lambda b, env: gemv(self._src(src, env, b).to(self.dt), wt, None, out(b),
                                   EPI_STORE)

    def _lower_attention(self, op):
        la = self.program.layers[op.layer]
        kv, D = self.kv, la.head_dim
        qn = self.w[op.weights[0] + ".weight"].contiguous()
        qk_norm = None        # [q | k] side by side: one norm + rotary launch, a norm per head
        if la.writes:
            kn = self.w[op.weights[1] + ".weight"]
            qk_norm = torch.cat([qn.repeat(la.n_heads), kn.repeat(la.n_kv_heads)]).contiguous()
        qk = self.program.segment(op.src[0])[1] + la.n_heads * D == \
            self.program.segment(op.src[1])[1]
        assert qk or not la.writes, "q and k side by side in one buffer"
        cos, sin = self.rot_of(la)
        src = la.source
        ring = kv.ring[src]

        def run(b, env):
            pos = env["pos"]
            q = self._view(op.src[0], b)
            k = v = None
            if la.writes:       # v first: with keys = values it is the raw k's scale-free norm
                k = self._view(op.src[1], b)
                v = self._view(op.src[2], b)
                norm_rotary_triton(k if la.k_eq_v else v, None, None, None, None, D, op.eps,
                                   out=v)
                buf, off, _ = self.program.segment(op.src[0])
                qk = self.bufs[buf][:b, off:off + (la.n_heads + la.n_kv_heads) * D]
                norm_rotary_triton(qk, qk_norm, cos, sin, pos, D, op.eps, out=qk)
            else:
                norm_rotary_triton(q, qn, cos, sin, pos, D, op.eps, out=q)
            out = self._view(op.dst[0], b)
            if env["mode"] == "decode":
                if k is not None:
                    slot = state_slot(pos, kv.k[src].shape[2], ring)
                    rows = env["rows"]
                    kv.k[src][rows, :, slot] = k.view(b, la.n_kv_heads, D)
                    kv.v[src][rows, :, slot] = v.view(b, la.n_kv_heads, D)
                rows_decode_triton(q, kv.k[src], kv.v[src], env["rows"], pos, la.window, ring,
                                   la.scale, out, env["attn_len"])
            else:
                row, start, views = env["row"], env["start"], env["views"]
                if k is not None:
                    views[src] = prefill_keys(k.view(b, -1, D), v.view(b, -1, D),
                                              kv.k[src][row], kv.v[src][row], start, ring)
                out.copy_(prefill_attention(q.view(b, -1, D), *views[src], start, la.window,
                                            la.scale).reshape(b, -1))
        return run

    def _feed(self, ids):
        b = ids.shape[0]
        x, tok = self.embed(ids)
        self.x[:b].copy_(x)
        if tok is not None:
            self._view("ple_tok", b).copy_(tok)

    def forward(self, st, b: int, attn_len: int) -> None:
        self._feed(st.out[:b, 0])
        env = {"mode": "decode", "pos": st.pos[:b].clamp(max=self.kv.capacity - 1),
               "rows": st.row_ids[:b], "attn_len": attn_len}
        for f in self.lowered:
            f(b, env)
        row_advance(self.x[:b], st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                    st.kind[:b], st.first[:b], st.phase_next)

    def head_logits(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        b = hidden.shape[0]
        env = {"hidden": hidden}
        for f in self.heads[name]:
            f(b, env)
        return self._view(self.program.head(name).logits, b)

    def head_pick(self, name: str, st, b: int) -> None:
        h = self.program.head(name)
        masked_argmax(self.head_logits(name, st.hidden[:b]), st.out, h.col, segments=h.segments)

    def prefill(self, ids: torch.Tensor, row: int, start: int) -> torch.Tensor:
        T = ids.shape[0]
        assert T <= self.max_rows, f"fused prefill takes up to {self.max_rows} tokens"
        self._feed(ids)
        env = {"mode": "prefill", "pos": start + torch.arange(T, device=ids.device),
               "row": row, "start": start, "views": {}}
        for f in self.lowered:
            f(T, env)
        return self.x[:T]


class Gemma4StepState:
    """The rows' device state as fast/decode_step.StepState keeps it (hidden, pos, phase,
    kind, first, active, out, row ids, phase table), with a Gemma backend: decode_step's
    pieces (lm_greedy, forward) run on it unchanged."""

    def __init__(self, spec, weights, rows: int, capacity: int, fused: bool = False):
        emb = weights[dict(spec.program.feedback.weights)["wte"]]
        dev, dt = emb.device, emb.dtype
        self.spec, self.program, self.rows = spec, spec.program, rows
        self.kv = Gemma4StateCache(spec.program, rows, capacity, dev, dt)
        self.hidden = torch.zeros(rows, spec.program.dim, device=dev, dtype=dt)
        for n in ("pos", "phase", "kind"):
            setattr(self, n, torch.zeros(rows, device=dev, dtype=torch.long))
        self.first = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.active = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.out = torch.zeros(rows, 4, device=dev, dtype=torch.long)
        self.row_ids = torch.arange(rows, device=dev)
        self.phase_next = torch.tensor(spec.phase_next, device=dev, dtype=torch.long)
        self.eager = EagerGemma4Backend(spec, weights, self.kv)
        self.fused = FusedGemma4Backend(spec, weights, self.kv, rows) \
            if fused else None
        self.backend = self.fused or self.eager

    def set_row(self, row: int, hidden: torch.Tensor, pos: int) -> None:
        self.hidden[row].copy_(hidden)
        self.pos[row:row + 1].fill_(pos)
        self.phase[row:row + 1].fill_(0)
        self.kind[row:row + 1].fill_(0)
        self.first[row:row + 1].fill_(True)


__all__ = ["EagerGemma4Backend", "FusedGemma4Backend", "Gemma4StateCache",
           "Gemma4StepState"]
