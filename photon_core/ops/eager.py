"""The eager interpreter of a step program's ops (photon_core/program.py): each op's torch
reference, in the program's order, over a dict of named tensors. Shape-agnostic over the
leading dimensions ([T, dim] rows or [1, T, dim] sequences); the attention op is the caller's
(`attend(state_slot, qkv) -> out`): the runtime's decode / prefill forms, or a family
reference's own."""
from __future__ import annotations

import torch.nn.functional as F

from .layernorm import layer_norm_reference, rms_norm_reference

ACTS = {None: lambda t: t, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu}


def run_ops(ops, env: dict, weights, attend=None, layer_slot=None) -> dict:
    """Run ops over env (name -> tensor; "x" the residual stream); weights: name -> tensor
    (a missing ".bias" is no bias). layer_slot maps an attention op's layer to its state
    slot (default: the layer itself)."""
    for op in ops:
        k = op.kind
        if k == "norm":
            x, wn = env[op.src[0]], op.weights[0]
            env[op.dst[0]] = (layer_norm_reference(x, weights[wn + ".weight"],
                                                   weights.get(wn + ".bias"), op.eps)
                              if op.norm == "layer" else
                              rms_norm_reference(x, weights[wn + ".weight"], op.eps))
        elif k == "linear":
            x = env[op.src[0]]
            for dst, wn, act in zip(op.dst, op.weights, op.acts):
                env[dst] = ACTS[act](F.linear(x, weights[wn + ".weight"],
                                              weights.get(wn + ".bias")))
        elif k == "attention":
            slot = op.layer if layer_slot is None else layer_slot[op.layer]
            env[op.dst[0]] = attend(slot, env[op.src[0]])
        elif k == "residual":
            x = env[op.dst[0]]
            for src, wn in zip(op.src, op.weights):
                x = x + F.linear(env[src], weights[wn + ".weight"], weights.get(wn + ".bias"))
            env[op.dst[0]] = x
        elif k == "act_mul":
            env[op.dst[0]] = ACTS[op.acts[0]](env[op.src[0]]) * env[op.src[1]]
        else:
            raise ValueError(f"no torch reference for op {k!r}")
    return env
