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
  fast=True, kernels=True (default on CUDA with triton) - the fused form: per layer
    * ops/rope_kv_write.py: one Triton pass from the qkv GEMM output to the rotated q
      (token-major: SDPA's output is then token-major too, so [n, h, P, hd] -> [n, P, dim]
      is a view), the rotated k in kv[i, 0] (the decode kernel's rotation math) and v in
      kv[i, 1] (was: fp32 cast, 2 gathers, multiply-add, cast back, 2 cache copies);
    * the residual x + (a Wproj^T + b_proj) + (g Wfc2^T + b_fc2): the proj GEMM with its
      bias, the fc2 GEMM accumulated onto it by cuBLAS (addmm_, beta = 1: no extra pass),
      then x + t + b_fc2 and the NEXT layer's LayerNorm in one Triton kernel
      (ops/add_layernorm.py with t_bias; was: 2 adds + a LayerNorm);
    * fc1 + tanh-GELU as one GEMM (ops/linear_gelu.py, as before).
    Close to fast=True, kernels=False (other roundings: the sum x + t + b is rounded once,
    the GEMMs' sum once), not bitwise. kernels=True runs on the CPU too under
    TRITON_INTERPRET=1 (the tests), with linear_gelu's reference there.
    hidden=False (the runtime's encode, which keeps only the k/v): the fused form stops at
    the last k/v write - no attention, output projection or MLP after the last layer's
    qkv GEMM, whose outputs no cache entry needs (~1/24 of the prefill's GEMMs); every k/v
    the same bits as with hidden=True (the same calls up to there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops._triton import HAVE_TRITON
from ...ops.add_layernorm import add_layernorm
from ...ops.eager import norm_reference, run_ops
from ...ops.linear_gelu import linear_gelu
from ...ops.rope_kv_write import rope_kv_write
from .config import TextConfig
from .layers import Weights
from .program import decoder_ops
from ...ops.rope import rope, rope_tables
from .rope import apply_rope, rope_angles
from .text import attention_mask

ATTENTION_FORMS = ("span", "prefix")


def prefill_prefix(w: Weights, cfg: TextConfig, x: torch.Tensor, kv: torch.Tensor,
                   prefix_len: int, fast: bool = False,
                   attention: str | None = None, kernels: bool | None = None,
                   hidden: bool = True) -> torch.Tensor | None:
    """x [n, P, dim] at positions 0..P-1 (P <= prefix_len: all inside the bidirectional
    prefix) -> writes kv [n_layers, 2, n, Hkv, P, D] (k in the interleaved rope order, as
    every cache); returns the last hidden states [n, P, dim] (before post_ln).
    attention: "span" | "prefix" (default: "prefix" when fast, else "span").
    kernels: the fused form of fast=True (module doc); None = on CUDA when triton imports.
    hidden=False: the fused form returns None after the last k/v write (module doc); the
    other forms ignore it."""
    attention = attention or ("prefix" if fast else "span")
    if kernels is None:
        kernels = fast and x.is_cuda and HAVE_TRITON
    if kernels and not fast:
        raise ValueError("the fused kernels are a form of fast=True")
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
    if kernels:
        return _prefill_fused(w, cfg, x, kv, ops if hidden else kv_ops(ops), hidden)
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


def kv_ops(ops) -> list:
    """decoder_ops cut to what the k/v writes need: the ops up to the last attention (its
    k/v write is the last one), each linear's outputs that a later one of them reads, and
    the last attention marked to write its k/v only (dst ())."""
    from dataclasses import replace
    last = max(i for i, op in enumerate(ops) if op.kind == "attention")
    out, reads = [], set()
    for i in range(last, -1, -1):
        op = ops[i]
        if i == last:
            op = replace(op, dst=())
        elif op.kind == "linear":
            keep = [j for j, d in enumerate(op.dst) if d in reads]
            op = replace(op, dst=tuple(op.dst[j] for j in keep),
                         weights=tuple(op.weights[j] for j in keep),
                         acts=tuple(op.acts[j] for j in keep))
        out.append(op)
        reads |= set(op.src)
    return out[::-1]


def _prefill_fused(w: Weights, cfg: TextConfig, x: torch.Tensor, kv: torch.Tensor,
                   ops, hidden: bool = True) -> torch.Tensor | None:
    """decoder_ops (or kv_ops's cut of them) run in the fused form (module doc): the ops'
    order and weights, with the residual + next norm and the attention's input passes
    fused; an attention op without dst writes its k/v only."""
    n, length, dim = x.shape
    nh, nkv = cfg.n_heads, cfg.n_kv_heads
    cos, sin = rope_angles(torch.arange(length, device=x.device), cfg.rot_dim)
    env = {"x": x}
    pending = {}                     # norm dst -> its output, computed by the fused add + LN

    def attend(i: int, qkv: torch.Tensor, out: bool = True) -> torch.Tensor | None:
        q = rope_kv_write(qkv, cos, sin, nh, nkv, kv[i, 0], kv[i, 1])
        if not out:
            return None
        a = F.scaled_dot_product_attention(q.transpose(1, 2), kv[i, 0], kv[i, 1],
                                           enable_gqa=nh != nkv)
        return a.transpose(1, 2).reshape(n, length, dim)

    for k, op in enumerate(ops):
        if op.kind == "norm":
            got = pending.pop(op.dst[0], None)
            env[op.dst[0]] = got if got is not None else norm_reference(op, env[op.src[0]], w)
        elif op.kind == "linear":
            src = env[op.src[0]]
            for dst, wn, act in zip(op.dst, op.weights, op.acts):
                if act == "gelu_tanh":
                    env[dst] = linear_gelu(src, w[wn + ".weight"], w.get(wn + ".bias"))
                elif act is None:
                    env[dst] = F.linear(src, w[wn + ".weight"], w.get(wn + ".bias"))
                else:
                    raise ValueError(f"no fused prefill form for activation {act!r}")
        elif op.kind == "attention":
            a = attend(op.layer, env[op.src[0]], bool(op.dst))
            if op.dst:
                env[op.dst[0]] = a
        elif op.kind == "residual":
            resid = env[op.dst[0]]
            # the branches' GEMMs summed by cuBLAS into one [rows, dim] tensor t (the first
            # with its bias, the others accumulated in place); the last bias is added with
            # the residual in the add + LayerNorm kernel
            t = None
            for j, (src, wn) in enumerate(zip(op.src, op.weights)):
                a = env[src].reshape(-1, env[src].shape[-1])
                wt, b = w[wn + ".weight"], w.get(wn + ".bias")
                if t is None:
                    t = F.linear(a, wt, b)
                    continue
                t.addmm_(a, wt.t())
                if b is not None and j < len(op.src) - 1:
                    t.add_(b)
            tb = w.get(op.weights[-1] + ".bias") if len(op.src) > 1 else None
            t = t.view(resid.shape)
            nxt = ops[k + 1] if k + 1 < len(ops) else None
            if (nxt is not None and nxt.kind == "norm" and nxt.norm == "layer"
                    and nxt.src[0] == op.dst[0] and resid.dtype == t.dtype):
                wn = nxt.weights[0]
                env[op.dst[0]], pending[nxt.dst[0]] = add_layernorm(
                    resid, t, w[wn + ".weight"], w[wn + ".bias"], eps=nxt.eps, t_bias=tb)
            else:                    # the last block: the sum alone, rounded once
                s = resid.float() + t.float()
                env[op.dst[0]] = (s if tb is None else s + tb.float()).to(resid.dtype)
        else:
            raise ValueError(f"no fused prefill form for op {op.kind!r}")
    return env["x"] if hidden else None


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
