"""The window_attention op (program.py; Gemma 4's layers) bound to the state cache's
per-layer k/v (static_kv_cache.py: "ring" layers of `window` slots, "kv" layers over the
capacity, each of its own head size), for both backends.

The op's parameters (LayerAttention, its "attn" param) say per layer: heads, head size,
RoPE, window, the source layer whose state it reads (KV-shared layers compute no k/v), keys
= values, the score scale. One op:
  q (and k) per-head RMSNorm with their weights, v a scale-free RMSNorm (of the raw k when
  keys = values), rotate-half RoPE of the layer's table at each row's position; unless
  KV-shared: k/v written into the layer's state (a ring: position p in slot p % S); then
  attention over the source layer's state (a ring's S slots, or the capacity with the
  window as a mask).

Forms:
  decode   rows [0, b) at their own positions (device tensors: graph-capturable);
           eager: `decode_ops` (the ops' torch references), fused: `lower_fused` (the norm +
           rotary kernel with a weight per head for q|k side by side, the k/v slot write
           (ops/kv_slot_write.py), the rows' window attention kernel).
  prefill  one row's prompt chunk at device positions pos [T], the first n_valid tokens real
           (padding after them: graphed prompt buckets). A ring keeps the last S REAL
           positions (each slot takes the latest real token landing on it, else keeps its
           key); the chunk's queries attend to the positions before the chunk (the ring's
           keys, or the full state) and the chunk's own keys; KV-shared layers attend to
           their source layer's view of that same chunk.

Rotary tables: one (cos, sin) pair [capacity + PAD_POSITIONS, D] per distinct (head size, theta,
rotated fraction, factor) in the model's dtype (`RotaryTables`).
"""
from __future__ import annotations

import torch

from ..ops.rmsnorm_scaled import rmsnorm_scaled
from ..ops.rotary_half import apply_rotary_half, cos_sin, inv_freq
from ..ops.sliding_window_attention import attend_at_positions, rows_decode_reference, state_slot

KIND = "window_attention"
# positions past the capacity a padded prompt bucket's padding tokens may take (graphed
# prefill buckets are at most 128 tokens): the tables cover them, no clamp needed
PAD_POSITIONS = 129


def uses_window_attention(program) -> bool:
    return any(op.kind == KIND for op in program.ops)


class RotaryTables:
    def __init__(self, program, capacity: int, device, dtype):
        positions = torch.arange(capacity + PAD_POSITIONS, device=device)
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for op in program.ops:
            if op.kind != KIND:
                continue
            la = op.param("attn")
            if la.rope not in self.tables:
                f = inv_freq(la.head_dim, la.theta, la.rotary_fraction, la.factor)
                self.tables[la.rope] = tuple(t.contiguous() for t in cos_sin(positions, f, dtype))

    def of(self, la) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[la.rope]


def _qkv_reference(op, srcs, w, tables: RotaryTables, pos):
    """q [n, Hq, D] normed + rotated; k, v [n, Hkv, D] (None on KV-shared layers)."""
    la = op.param("attn")
    cos, sin = (t[pos] for t in tables.of(la))
    n, D = pos.shape[0], la.head_dim
    q = srcs[0].reshape(n, la.n_heads, D)
    q = apply_rotary_half(rmsnorm_scaled(q, w[op.weights[0] + ".weight"], op.eps), cos, sin)
    if not la.writes:
        return la, q, None, None
    k_raw = srcs[1].reshape(n, la.n_kv_heads, D)
    v_raw = k_raw if la.k_eq_v else srcs[2].reshape(n, la.n_kv_heads, D)
    k = apply_rotary_half(rmsnorm_scaled(k_raw, w[op.weights[1] + ".weight"], op.eps), cos, sin)
    return la, q, k, rmsnorm_scaled(v_raw, None, op.eps)


def write_rows(kv, layer: int, rows, pos, k, v) -> None:
    """A decode step's k/v [b, Hkv, D] into rows [b] at positions pos [b] (clamped)."""
    slot = state_slot(pos, kv.k[layer].shape[2], kv.ring[layer])
    kv.k[layer][rows, :, slot] = k
    kv.v[layer][rows, :, slot] = v


def decode_ops(program, w, kv, tables: RotaryTables, rows, pos, attn_len: int) -> dict:
    """{"window_attention": fn(op, srcs)} for rows [0, b) at positions pos [b] (clamped to
    the capacity - 1)."""
    def window_attention(op, srcs):
        la, q, k, v = _qkv_reference(op, srcs, w, tables, pos)
        src = la.source
        if k is not None:
            write_rows(kv, src, rows, pos, k, v)
        a = rows_decode_reference(q, kv.k[src], kv.v[src], rows, pos, la.window,
                                  kv.ring[src], la.scale, attn_len)
        return a.reshape(a.shape[0], -1)
    return {KIND: window_attention}


def prefill_write(kv, layer: int, row, pos, n_valid, k, v):
    """One row's chunk k, v [T, Hkv, D] at positions pos [T] (row [1], n_valid [1] or None:
    all real) into the layer's state; -> the keys its queries attend to: (keys, values
    [Hkv, n, D], their positions [n], valid [n])."""
    kc, vc, ring = kv.k[layer], kv.v[layer], kv.ring[layer]
    T, S, dev = k.shape[0], kc.shape[2], k.device
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if not ring:
        slots = pos.clamp(max=S - 1)
        kc[row, :, slots] = k
        vc[row, :, slots] = v
        s = torch.arange(S, device=dev)
        return (kc.index_select(0, row)[0], vc.index_select(0, row)[0], s,
                torch.ones(S, dtype=torch.bool, device=dev))
    start = pos[:1]
    s = torch.arange(S, device=dev)
    k_old, v_old = kc.index_select(0, row)[0], vc.index_select(0, row)[0]
    old_pos = (start - 1) - torch.remainder(start - 1 - s, S)      # what slot s holds
    view = (torch.cat([k_old, kt], dim=1), torch.cat([v_old, vt], dim=1),
            torch.cat([old_pos, pos]),
            torch.cat([old_pos >= 0, torch.ones(T, dtype=torch.bool, device=dev)]))
    # slot s takes the chunk's latest real token t with (start + t) % S == s, if any
    nv = torch.full_like(start, T) if n_valid is None else n_valid
    t = (nv - 1) - torch.remainder(nv - 1 + start - s, S)
    take = (t >= 0)[None, :, None]
    idx = t.clamp(min=0)
    kc[row, :, s] = torch.where(take, kt[:, idx], k_old).transpose(0, 1)
    vc[row, :, s] = torch.where(take, vt[:, idx], v_old).transpose(0, 1)
    return view


def prefill_ops(program, w, kv, tables: RotaryTables, row, pos, n_valid) -> dict:
    """{"window_attention": fn(op, srcs)} for one row's chunk (row [1], pos [T], n_valid)."""
    views = {}

    def window_attention(op, srcs):
        la, q, k, v = _qkv_reference(op, srcs, w, tables, pos)
        if k is not None:
            views[la.source] = prefill_write(kv, la.source, row, pos, n_valid, k, v)
        a = attend_at_positions(q, *views[la.source], pos, la.window, la.scale)
        return a.reshape(a.shape[0], -1)
    return {KIND: window_attention}


def lower_fused(be, op):
    """The fused backend's lowering of one window_attention op -> fn(b, env); env["window"]
    = ("decode", rows, pos, attn_len) or ("prefill", row, pos, n_valid, views)."""
    from ..ops.kv_slot_write import kv_slot_write_triton
    from ..ops.rotary_half import norm_rotary_triton
    from ..ops.sliding_window_attention import rows_decode_triton
    la = op.param("attn")
    kv, D, p = be.kv, la.head_dim, be.program
    qn = be.w[op.weights[0] + ".weight"].contiguous()
    qk_norm = None        # [q | k] side by side: one norm + rotary launch, a norm per head
    if la.writes:
        kn = be.w[op.weights[1] + ".weight"]
        qk_norm = torch.cat([qn.repeat(la.n_heads), kn.repeat(la.n_kv_heads)]).contiguous()
        qbuf, qoff, _ = p.segment(op.src[0])
        kbuf, koff, _ = p.segment(op.src[1])
        if (kbuf, koff) != (qbuf, qoff + la.n_heads * D):
            raise ValueError(f"window_attention of layer {op.layer}: q and k must lie side "
                             "by side in one buffer")
    cos, sin = be.rotary.of(la)
    src = la.source

    def run(b, env):
        form = env["window"]
        pos = form[2]
        pdl = be.pdl_at(b) and form[0] == "decode"     # (a prefill's torch ops launch plainly)
        q = be._view(op.src[0], b)
        k = v = None
        if la.writes:       # v first: with keys = values it is the raw k's scale-free norm
            k, v = be._view(op.src[1], b), be._view(op.src[2], b)
            norm_rotary_triton(k if la.k_eq_v else v, None, None, None, None, D, op.eps, out=v,
                               pdl=pdl)
            qk = be.bufs[qbuf][:b, qoff:qoff + (la.n_heads + la.n_kv_heads) * D]
            norm_rotary_triton(qk, qk_norm, cos, sin, pos, D, op.eps, out=qk, pdl=pdl)
        else:
            norm_rotary_triton(q, qn, cos, sin, pos, D, op.eps, out=q, pdl=pdl)
        out = be._view(op.dst[0], b)
        if form[0] == "decode":
            rows, attn_len = form[1], form[3]
            if k is not None:         # k and v at each row's slot: one launch
                kv_slot_write_triton(k, v, kv.k[src], kv.v[src], rows, pos, kv.ring[src],
                                     pdl=pdl)
            rows_decode_triton(q, kv.k[src], kv.v[src], rows, pos, la.window, kv.ring[src],
                               la.scale, out, attn_len, pdl=pdl)
        else:
            row, n_valid, views = form[1], form[3], form[4]
            if k is not None:
                views[src] = prefill_write(kv, src, row, pos, n_valid,
                                           k.view(b, -1, D), v.view(b, -1, D))
            out.copy_(attend_at_positions(q.view(b, -1, D), *views[src], pos, la.window,
                                   la.scale).reshape(b, -1))
    return run
