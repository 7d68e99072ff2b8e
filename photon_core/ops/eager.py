"""The eager interpreter of a step program's ops (photon_core/program.py): each op's torch
reference, in the program's order, over a dict of named tensors. Shape-agnostic over the
leading dimensions ([T, dim] rows or [1, T, dim] sequences); the attention op is the caller's
(`attend(state_slot, qkv) -> out`): the runtime's decode / prefill forms, or a family
reference's own); the stateful ops of hybrid programs (conv1d, delta_rule, gated_attention)
too (`stateful[kind](op, env) -> out`)."""
from __future__ import annotations

import torch.nn.functional as F

from .layernorm import layer_norm_reference, rms_norm_reference
from .rmsnorm_gated import rmsnorm_gated
from .rmsnorm_zero_centred import rmsnorm_zero_centred

ACTS = {None: lambda t: t, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu}


def norm_reference(op, x, weights):
    """A norm op's torch reference (kinds "layer", "rms", "rms_zc")."""
    wn = op.weights[0]
    if op.norm == "layer":
        return layer_norm_reference(x, weights[wn + ".weight"], weights.get(wn + ".bias"), op.eps)
    if op.norm == "rms_zc":
        return rmsnorm_zero_centred(x, weights[wn + ".weight"], op.eps)
    return rms_norm_reference(x, weights[wn + ".weight"], op.eps)


def gated_norm_reference(op, o, z, weights):
    """gated_norm: per group of op.size channels (one head)."""
    shape = o.shape
    y = rmsnorm_gated(o.reshape(*shape[:-1], -1, op.size), z.reshape(*shape[:-1], -1, op.size),
                      weights[op.weights[0] + ".weight"], op.eps)
    return y.reshape(shape)


def run_ops(ops, env: dict, weights, attend=None, layer_slot=None, stateful=None) -> dict:
    """Run ops over env (name -> tensor; "x" the residual stream); weights: name -> tensor
    (a missing ".bias" is no bias). layer_slot maps an attention op's layer to its state
    slot (default: the layer itself)."""
    for op in ops:
        k = op.kind
        if k == "norm":
            env[op.dst[0]] = norm_reference(op, env[op.src[0]], weights)
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
        elif k == "gated_norm":
            env[op.dst[0]] = gated_norm_reference(op, env[op.src[0]], env[op.src[1]], weights)
        elif stateful is not None and k in stateful:
            env[op.dst[0]] = stateful[k](op, env)
        else:
            raise ValueError(f"no torch reference for op {k!r}")
    return env
