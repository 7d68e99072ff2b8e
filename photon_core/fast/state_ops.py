"""The stateful ops of a step program bound to the state cache, for the backends: the hybrid
ops gated_attention (k/v rows), conv1d ("conv" row states) and delta_rule ("recurrent" row
states, fp32) in their decode form (rows [0, b) of a bucket, each at its own position, state
written only for active rows) and their prefill form (one row's prompt, the first n_valid
tokens reaching the recurrent state). Their math is the ops' torch references
(ops/gated_attention.py, ops/gated_delta_net.py); both backends run them through here until
the fused backend lowers them to kernels.

Each binder returns {op kind: fn(op, srcs) -> out}, srcs the op's source tensors in order.
"""
from __future__ import annotations

import torch

from ..ops.gated_attention import gated_attention_prefill, gated_attention_rows
from ..ops.gated_delta_net import (conv1d_prefill_row, conv1d_rows, delta_rule_prefill_row,
                                   delta_rule_rows)


def _conv_weight(w, op) -> torch.Tensor:
    t = w[op.weights[0] + ".weight"]
    return t[:, 0] if t.dim() == 3 else t


def _dims(program) -> tuple[int, int, int, int]:
    d = program.delta
    return d.n_k_heads, d.n_v_heads, d.k_dim, d.v_dim


def _with_row(states: torch.Tensor, row: torch.Tensor, fn):
    """fn(the row's state [1, ...], updated in place) -> out; the state written back (row a
    device tensor: no host sync, graph-capturable)."""
    st = states.index_select(0, row)
    out = fn(st)
    states.index_copy_(0, row, st)
    return out


KINDS = ("gated_attention", "conv1d", "delta_rule")


def uses_state_ops(program) -> bool:
    return any(op.kind in KINDS for op in program.ops)


def decode_ops(program, w, kv, rows, pos, offset, active, attn_len) -> dict:
    """A decode step over rows [0, b) (rows = arange(b) on the device, pos [b]); offset [b]:
    rotary position offsets; active [b] bool."""
    a = program.attention
    slot = {layer: i for i, layer in enumerate(program.kv_layers)}
    b = pos.shape[0]

    def gated_attention(op, srcs):
        i = slot[op.layer]
        return gated_attention_rows(*srcs, w[op.weights[0] + ".weight"],
                                    w[op.weights[1] + ".weight"], kv.data[i, 0], kv.data[i, 1],
                                    rows, pos, pos + offset, attn_len, a, op.eps)

    def conv1d(op, srcs):
        return conv1d_rows(srcs[0], _conv_weight(w, op), kv.states[("conv", op.layer)][:b],
                           active)

    def delta_rule(op, srcs):
        return delta_rule_rows(*srcs, w[op.weights[0]], w[op.weights[1]],
                               kv.states[("recurrent", op.layer)][:b], _dims(program), active)
    return {"gated_attention": gated_attention, "conv1d": conv1d, "delta_rule": delta_rule}


def prefill_ops(program, w, kv, row, pos, offset, n_valid) -> dict:
    """One row's prompt: row [1], pos [T] cache positions, offset [1] (or an int), n_valid [1]
    (or None: every token is real)."""
    a = program.attention
    slot = {layer: i for i, layer in enumerate(program.kv_layers)}

    def gated_attention(op, srcs):
        i = slot[op.layer]
        return gated_attention_prefill(*srcs, w[op.weights[0] + ".weight"],
                                       w[op.weights[1] + ".weight"], kv.data[i, 0],
                                       kv.data[i, 1], row, pos, pos + offset, a, op.eps)

    def conv1d(op, srcs):
        return _with_row(kv.states[("conv", op.layer)], row, lambda st: conv1d_prefill_row(
            srcs[0], _conv_weight(w, op), st, n_valid))

    def delta_rule(op, srcs):
        return _with_row(kv.states[("recurrent", op.layer)], row,
                         lambda st: delta_rule_prefill_row(*srcs, w[op.weights[0]],
                                                           w[op.weights[1]], st,
                                                           _dims(program), n_valid))
    return {"gated_attention": gated_attention, "conv1d": conv1d, "delta_rule": delta_rule}
