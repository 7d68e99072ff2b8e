"""The image-prefix prefill of several frames at once: [n, P, dim] prefix embeddings (BOS +
729 image tokens each) through the text decoder's blocks in one batched pass, writing every
frame's prefix k/v.

Two forms of the blocks (program.decoder_ops, run by ops/eager.run_ops, with the batch as
the leading dimension):

  fast=False - the reference's (text.decoder): attention "span": SDPA over the whole context span (max_context
    keys) with the boolean prefix mask, keys beyond the prefix zero-padded. Per frame
    bit-identical to text.decoder on the CPU (fp32 and bf16: the batched GEMMs, LayerNorms
    and SDPA compute each row / (batch, head) alike; tested).
  "prefix" - the same attention without the mask and the padding: inside the image prefix
    every token sees every prefix token (text.attention_mask: q, k < prefix_len), and the
    keys beyond it are masked, so attention over exactly the P prefix keys with no mask is
    the same math. On CUDA that is the flash kernel over 730 keys instead of a masked
    (memory-efficient) kernel over 2048 and two padded k/v copies per layer. Other
    summation order: close, not bitwise (fp32: ~1e-6 relative).
  fast=True - attention "prefix"; q and k rotated in one pass (ops/rope.rope); on CUDA the
    MLP's fc1 + tanh-GELU as one GEMM with a GELU epilogue (ops/linear_gelu.py). The
    runtime's encode (EngineOptions.encoder). fast=True with attention="span" is not a form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.eager import run_ops
from ...ops.linear_gelu import linear_gelu
from .config import TextConfig
from .layers import Weights
from .program import decoder_ops
from ...ops.rope import rope, rope_tables
from .rope import apply_rope, rope_angles
from .text import attention_mask

ATTENTION_FORMS = ("span", "prefix")


def prefill_prefix(w: Weights, cfg: TextConfig, x: torch.Tensor, kv: torch.Tensor,
                   prefix_len: int, fast: bool = False,
                   attention: str | None = None) -> torch.Tensor:
    """x [n, P, dim] at positions 0..P-1 (P <= prefix_len: all inside the bidirectional
    prefix) -> writes kv [n_layers, 2, n, Hkv, P, D] (k in the interleaved rope order, as
    every cache); returns the last hidden states [n, P, dim] (before post_ln).
    attention: "span" | "prefix" (default: "prefix" when fast, else "span")."""
    attention = attention or ("prefix" if fast else "span")
    if fast and attention != "prefix":
        raise ValueError("the fast form attends over the prefix keys only")
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention must be one of {ATTENTION_FORMS}, not {attention!r}")
    n, length, dim = x.shape
    if length > prefix_len:
        raise ValueError(f"{length} tokens do not fit the {prefix_len}-token image prefix")
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    if tuple(kv.shape) != (cfg.n_layers, 2, n, nkv, length, hd):
        raise ValueError(f"kv {tuple(kv.shape)} does not fit {n} frames of {length} tokens")
    cos, sin = rope_angles(torch.arange(length, device=x.device), cfg.rot_dim)
    span = cfg.max_context
    mask = None
    if attention == "span":
        # the reference's mask and shape ([1, 1, T, span]), broadcast over the frames
        mask = attention_mask(0, length, prefix_len, x.device, span)[None, None]

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(q.view(n, length, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(n, length, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(n, length, nkv, hd).transpose(1, 2)
        kv[i, 0] = k
        kv[i, 1] = v
        keys, values = kv[i, 0], kv[i, 1]
        if attention == "span":
            pad = (0, 0, 0, span - length)
            keys, values = F.pad(keys, pad), F.pad(values, pad)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                           enable_gqa=nh != nkv)
        return a.transpose(1, 2).reshape(n, length, dim)

    if fast:
        # q and k rotated together, as one [n, P, nh + nkv, hd] view of qkv, by the gather +
        # multiply-add form (ops/rope.rope: ~6 kernels per layer instead of ~20 for two
        # apply_rope calls; same rotation and output order, fp32 FMA rounding)
        perm = _rope_perms_on_device(cfg.rot_dim, hd, x.device)
        c, s = rope_tables(torch.arange(length, device=x.device), cfg.rot_dim, hd)
        c, s = c[:, 0], s[:, 0]                                 # [P, 1, hd]

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:  # noqa: F811
            nqk = (nh + nkv) * hd
            qk = rope(qkv[..., :nqk].view(n, length, nh + nkv, hd), c, s, perm)
            kv[i, 0] = qk[:, :, nh:].transpose(1, 2)
            kv[i, 1] = qkv[..., nqk:].view(n, length, nkv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(qk[:, :, :nh].transpose(1, 2), kv[i, 0],
                                               kv[i, 1], enable_gqa=nh != nkv)
            return a.transpose(1, 2).reshape(n, length, dim)

    ops = decoder_ops(cfg)
    if not (fast and x.is_cuda):
        return run_ops(ops, {"x": x}, w, attend)["x"]
    env = {"x": x}
    for op in ops:              # the reference's ops, but linear + gelu_tanh in one GEMM
        if op.kind == "linear" and "gelu_tanh" in op.acts:
            for dst, wn, act in zip(op.dst, op.weights, op.acts):
                env[dst] = (linear_gelu(env[op.src[0]], w[wn + ".weight"], w.get(wn + ".bias"))
                            if act == "gelu_tanh" else run_ops(
                                [_one_linear(op, dst, wn, act)], env, w)[dst])
        else:
            run_ops([op], env, w, attend)
    return env["x"]


def _rope_perms_on_device(rot_dim: int, head_dim: int, device) -> torch.Tensor:
    """ops/rope.rope_perms built with device ops only (arange arithmetic, no host list
    copied to the device), so it can run inside a CUDA graph capture."""
    half = rot_dim // 2
    c = torch.arange(rot_dim, device=device)
    odd = c % 2
    rest = torch.arange(rot_dim, head_dim, device=device)
    a = torch.cat([c // 2 + odd * half, rest])
    b = torch.cat([c // 2 + (1 - odd) * half, rest])
    return torch.stack([a, b])


def _one_linear(op, dst, wn, act):
    """The op restricted to one of its outputs."""
    from dataclasses import replace
    return replace(op, dst=(dst,), weights=(wn,), acts=(act,))


__all__ = ["ATTENTION_FORMS", "prefill_prefix"]
