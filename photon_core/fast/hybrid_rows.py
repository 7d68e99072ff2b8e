"""The fused backend's lowering of a hybrid program's ops (Qwen 3.5) to the rows kernels of
photon_core/ops/: each op one or two Triton launches over the decode bucket's rows, reading
and writing the backend's buffers as strided views (no copies), the state cache in place.

  norm "rms_zc"    rmsnorm_zero_centred_rows_triton      1 launch (decode and prefill)
  gated_norm       rmsnorm_gated_rows_triton             1 launch (decode and prefill)
  conv1d           causal_conv1d_rows_triton             1 launch (decode)
  delta_rule       gated_delta_rows_triton (gates in it) 1 launch (decode)
  gated_attention  qk_norm_rope_rows_triton (q/k norms, M-RoPE at pos + offset from a table,
                   k/v into the row's cache slot) + gated_gqa_decode_rows_triton (split
                   attention over min(pos + 1, attn_len) positions, combine x sigmoid(gate))
                                                         3 launches (decode)
  act_mul "silu"   silu_gate_triton (ops/silu_gate.py)   1 launch (decode and prefill)
  conv1d -> delta_rule -> gated_norm (FUSE_DELTA_NET; the conv output and the read-out read by
                   no later op): delta_net_rows_triton (ops/delta_net_rows.py)
                                                         1 launch (decode) instead of 3
The stateful ops of a prefill (one row's prompt) stay the torch references of state_ops.py.
With pdl (EngineOptions.pdl) the rms_zc norm, the fused DeltaNet kernel and the attention's
three kernels launch with programmatic dependent launch (ops/pdl.py), so a GEMV after them
starts loading its weights while they run; the other rows kernels launch plainly.
Row states and cache slots are written only for active rows (no clone of the state); every
per-step value (positions, offsets, active) is read on the device and the launch shapes
depend only on the bucket and attn_len: the step is capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from ..ops.causal_conv1d import causal_conv1d_rows_triton
from ..ops import delta_net_rows
from ..ops.gated_delta_rule import gated_delta_rows_triton
from ..ops.gqa_attention import RowsAttentionScratch, gated_gqa_decode_rows_triton
from ..ops.mrope import qk_norm_rope_rows_triton, rope_table
from ..ops.rmsnorm_gated import rmsnorm_gated_rows_triton
from ..ops.rmsnorm_zero_centred import rmsnorm_zero_centred_rows_triton
from ..ops.silu_gate import silu_gate_triton
from ..program import read_before_written


# the Gated DeltaNet layer's conv + delta rule + gated norm as one launch per decode step
# (False: three launches, the A/B baseline of bench/ab_switch.py)
FUSE_DELTA_NET = True


class RowsStep:
    """A decode step's per-row device tensors (the env's "rows")."""

    def __init__(self, pos, offset, active, attn_len: int):
        self.pos, self.offset, self.active, self.attn_len = pos, offset, active, attn_len


class RowsLowering:
    def __init__(self, backend, rows: int):
        self.be = backend
        p, kv = backend.program, backend.kv
        a = p.attention
        dev, dt = kv.data.device, kv.data.dtype
        self.a = a
        # rotary tables over every cache position (rotary positions pos + offset <= pos: the
        # M-RoPE position of text after an image is at most its cache position)
        self.cos, self.sin = rope_table(kv.capacity + 1, a.rot_dim, a.theta, a.mrope_section,
                                        dt, dev)
        self.q = torch.zeros(rows, a.n_heads, a.head_dim, device=dev, dtype=dt)
        self.zero_offset = torch.zeros(rows, device=dev, dtype=torch.long)
        self.rows, self.device = rows, dev
        self.scratch: dict[int, RowsAttentionScratch] = {}
        self._scratch(kv.capacity)                          # the graphs' attn_len
        self.dims = ((p.delta.n_k_heads, p.delta.n_v_heads, p.delta.k_dim, p.delta.v_dim)
                     if p.delta is not None else None)

    def _scratch(self, attn_len: int) -> RowsAttentionScratch:
        s = self.scratch.get(attn_len)
        if s is None:
            s = self.scratch[attn_len] = RowsAttentionScratch(
                self.rows, self.a.n_heads, self.a.head_dim, attn_len, self.device)
        return s

    def step(self, pos, offset, active, attn_len: int) -> RowsStep:
        b = pos.shape[0]
        self._scratch(attn_len)
        return RowsStep(pos, offset if offset is not None else self.zero_offset[:b], active,
                        attn_len)

    # -- lowering -----------------------------------------------------------------------
    def lower(self, op):
        """The op's closure (b, env), or None when the op is not a hybrid one."""
        k = op.kind
        if k == "norm" and op.norm == "rms_zc":
            return self._norm(op)
        if k == "gated_norm":
            return self._gated_norm(op)
        if k == "act_mul" and op.acts[0] == "silu":
            be = self.be
            (g, u), dst = op.src, op.dst[0]
            return lambda b, env: silu_gate_triton(be._view(g, b), be._view(u, b),
                                                   out=be._view(dst, b))
        if k == "conv1d":
            return self._decode_or_torch(op, self._conv1d(op))
        if k == "delta_rule":
            return self._decode_or_torch(op, self._delta_rule(op))
        if k == "gated_attention":
            return self._decode_or_torch(op, self._gated_attention(op))
        return None

    def lower_run(self, ops, i: int):
        """(closure, ops consumed) for a run of ops starting at ops[i] that lowers as one
        (FUSE_DELTA_NET: conv1d -> delta_rule -> gated_norm), else None."""
        if not FUSE_DELTA_NET or i + 3 > len(ops):
            return None
        conv, delta, norm = ops[i:i + 3]
        if not (conv.kind == "conv1d" and delta.kind == "delta_rule"
                and norm.kind == "gated_norm" and delta.src[0] == conv.dst[0]
                and norm.src[0] == delta.dst[0] and norm.size == self.dims[3]):
            return None
        if any(read_before_written(ops[i + 3:], seg) for seg in (conv.dst[0], delta.dst[0])):
            return None
        be = self.be
        cw = be.w[conv.weights[0] + ".weight"]
        cw = (cw[:, 0] if cw.dim() == 3 else cw).contiguous()
        cstate = be.kv.states[("conv", conv.layer)]
        a_log = be.w[delta.weights[0]].contiguous()
        dt_bias = be.w[delta.weights[1]].contiguous()
        state = be.kv.states[("recurrent", delta.layer)]
        nw = be.w[norm.weights[0] + ".weight"].contiguous()
        x, (_, bi, ai), z, dst = conv.src[0], delta.src, norm.src[1], norm.dst[0]
        dims, eps = self.dims, norm.eps
        three = [self.lower(op) for op in (conv, delta, norm)]      # a prefill's ops
        warps = delta_net_rows.NUM_WARPS

        def run(b, env):
            r = env.get("rows")
            if r is None:
                for f in three:
                    f(b, env)
                return
            delta_net_rows.delta_net_rows_triton(
                be._view(x, b), be._view(z, b), be._view(bi, b), be._view(ai, b), cw, cstate,
                a_log, dt_bias, nw, state, dims, eps, r.active, out=be._view(dst, b),
                num_warps=warps, pdl=be.pdl_at(b))
        return run, 3

    def _decode_or_torch(self, op, kernel):
        """Decode: the kernel; a prefill (no "rows" in env): the op's torch reference."""
        be, k = self.be, op.kind
        srcs, dst = op.src, op.dst[0]

        def run(b, env):
            rows = env.get("rows")
            if rows is not None:
                kernel(b, rows)
            else:
                be._view(dst, b).copy_(env["stateful"][k](op, [be._src(s, env, b)
                                                                for s in srcs]))
        return run

    def _norm(self, op):
        be = self.be
        w = be.w[op.weights[0] + ".weight"].contiguous()
        src, dst, eps = op.src[0], op.dst[0], op.eps
        return lambda b, env: rmsnorm_zero_centred_rows_triton(be._src(src, env, b), w,
                                                               be._view(dst, b), eps,
                                                               pdl=be.pdl_at(b))

    def _gated_norm(self, op):
        be = self.be
        w = be.w[op.weights[0] + ".weight"].contiguous()
        if w.shape != (op.size,):
            raise ValueError(f"gated_norm weight {tuple(w.shape)} != ({op.size},)")
        (o, z), dst, eps = op.src, op.dst[0], op.eps
        return lambda b, env: rmsnorm_gated_rows_triton(be._view(o, b), be._view(z, b), w,
                                                        be._view(dst, b), eps)

    def _conv1d(self, op):
        be = self.be
        w = be.w[op.weights[0] + ".weight"]
        w = (w[:, 0] if w.dim() == 3 else w).contiguous()
        state = be.kv.states[("conv", op.layer)]
        src, dst = op.src[0], op.dst[0]
        return lambda b, r: causal_conv1d_rows_triton(be._view(src, b), w, state, r.active,
                                                      out=be._view(dst, b))

    def _delta_rule(self, op):
        be = self.be
        a_log = be.w[op.weights[0]].contiguous()
        dt_bias = be.w[op.weights[1]].contiguous()
        state = be.kv.states[("recurrent", op.layer)]
        (qkv, bi, ai), dst = op.src, op.dst[0]
        dims = self.dims
        return lambda b, r: gated_delta_rows_triton(be._view(qkv, b), be._view(bi, b),
                                                    be._view(ai, b), a_log, dt_bias, state,
                                                    dims, r.active, out=be._view(dst, b))

    def _gated_attention(self, op):
        be, a = self.be, self.a
        hq, hkv, d = a.n_heads, a.n_kv_heads, a.head_dim
        qn = be.w[op.weights[0] + ".weight"].contiguous()
        kn = be.w[op.weights[1] + ".weight"].contiguous()
        slot = be.layer_slot[op.layer]
        kc, vc = be.kv.data[slot, 0], be.kv.data[slot, 1]
        (qg, k, v), dst, eps = op.src, op.dst[0], op.eps

        def run(b, r):
            qgh = be._view(qg, b).unflatten(1, (hq, 2 * d))
            q = self.q[:b]
            qk_norm_rope_rows_triton(qgh[..., :d], be._view(k, b).unflatten(1, (hkv, d)),
                                     be._view(v, b).unflatten(1, (hkv, d)), qn, kn, kc, vc,
                                     r.pos, r.offset, self.cos, self.sin, eps, r.active,
                                     q_out=q, pdl=be.pdl_at(b))
            gated_gqa_decode_rows_triton(q, kc, vc, r.pos, r.attn_len, qgh[..., d:],
                                         out=be._view(dst, b).unflatten(1, (hq, d)),
                                         scratch=self.scratch[r.attn_len], pdl=be.pdl_at(b))
        return run
