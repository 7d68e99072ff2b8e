"""The vision encoder with fewer passes over memory: vision.encoder's math, for the runtime's
encode (EngineOptions.encoder = "fast"; the reference stays vision.encoder).

Differences, each an equivalent form (close, not bitwise, in bf16 on CUDA):
  - the MLP's fc1 + tanh-GELU is one GEMM with a GELU epilogue (ops/linear_gelu.py: no
    second pass over the [crops*729, 4304] intermediate); on the CPU the reference form;
  - each residual add and the LayerNorm that reads its sum are one Triton kernel on CUDA
    (ops/add_layernorm.py: the sum is read once, not twice; 54 per encode);
  - q, k, v are strided views of the fused qkv GEMM's output ([n, t, 3, heads, hd] permuted)
    handed to SDPA as they are (vision.encoder's chunk + view + transpose gives the same
    views; kept here for clarity), and the attention output's [n, heads, t, hd] ->
    [n, t, d] copy is the one transpose+reshape.
Attention: SDPA picks cuDNN for [crops, 16, 729, 72] bf16 on the H200 (3.9 ms for 27 layers,
the fastest of cuDNN / flash / efficient / math measured, docs/benchmarks.md), as before.
attention="triton" (opt-in, measured by bench/probe_encode.py before it can be a default):
ops/vision_attention.py, a Triton flash kernel that reads q / k / v straight from the qkv
GEMM output and computes head 72 as 64 + 16 columns instead of cuDNN's 128-wide tiles.
attention="gluon" (Hopper only): the same split head as a Gluon kernel with TMA and
asynchronous wgmma, each warpgroup its own partition (ops/vision_attention_gluon.py); the
default "auto" takes it where it runs (session 44, H100: 27 calls 2.170 vs cuDNN 2.372 ms;
the 9-crop encode graph 15.51 / 15.56 vs 15.66 / 15.70 ms), else SDPA.
On the CPU (fp32) every op is the reference's: bit-identical to vision.encoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops._triton import HAVE_TRITON
from ...ops.add_layernorm import add_layernorm
from ...ops.linear_gelu import linear_gelu
from ...ops.vision_attention import vision_attention
from ...ops.vision_attention_gluon import parse_config, takes, vision_attention_gluon
from .config import VisionConfig
from .layers import Weights
from .vision import patchify


ATTENTION_FORMS = ("auto", "sdpa", "triton", "gluon")
# a captured encode is cut into two graphs after this block (the `cut` hook; None: one
# graph): the host's launch of the second (most of the encode's ~540 nodes) overlaps the
# GPU's work on the first instead of delaying the encode's first kernel (H200, session 21
# call 6: encode_image 15.31 / 15.40 vs 15.41 / 15.59 ms as one graph, the same bits; the
# gap before the encode's first kernel in run(frame, detect) 238 -> 110-162 us)
CUT_AFTER_BLOCK: int | None = 0
# the runtime encode's attention (encoder's attention=None): "auto" (gluon where its kernel
# runs - a Hopper GPU, Triton with Gluon, bf16 / fp16 -, else sdpa), "sdpa",
# "triton[:CONFIG]" with CONFIG as BLOCK_MxBLOCK_NxWARPSxSTAGES (ops/vision_attention.py), or
# "gluon[:BMxBNxSTAGES[xPIPE[xWS]]]" (ops/vision_attention_gluon.py). A switch for the A/B
# benches (session 42: triton 2.67 ms per 27 calls vs cuDNN 2.34; session 44 on an H100:
# gluon's default config 2.170 vs cuDNN 2.372 ms, the encode graph 1.009x)
ATTENTION = "auto"


def _attention_choice(attention: str | None, config: tuple | None):
    """(form, config) of encoder's arguments, ATTENTION's where attention is None."""
    if attention is not None:
        return attention, config
    form, _, cfg = ATTENTION.partition(":")
    if not cfg:
        return form, None
    if form == "gluon":
        return form, parse_config(cfg)
    return form, tuple(int(v) for v in cfg.split("x"))


def encoder(w: Weights, cfg: VisionConfig, crops: torch.Tensor,
            fuse_norms: bool | None = None, attention: str | None = None,
            attention_config: tuple | None = None, cut=None) -> torch.Tensor:
    """fuse_norms: each residual add and the LayerNorm after it in one Triton kernel
    (ops/add_layernorm.py); None = on CUDA when triton imports. attention: "auto" (gluon
    where ops/vision_attention_gluon.takes the first qkv, else sdpa) | "sdpa" | "triton"
    (ops/vision_attention.py; attention_config: its (BLOCK_M, BLOCK_N, warps, stages)) |
    "gluon" (ops/vision_attention_gluon.py, a Hopper GPU; attention_config: its (BM, BN,
    STAGES, PIPE, WS)); None: the module's ATTENTION. cut: called after block
    CUT_AFTER_BLOCK (a graph capture's cut point, cuda_graph_runner.capture_graph_parts)."""
    attention, attention_config = _attention_choice(attention, attention_config)
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention must be one of {ATTENTION_FORMS}, not {attention!r}")
    if fuse_norms is None:
        fuse_norms = crops.is_cuda and HAVE_TRITON

    def add_norm(x, t, name):               # (x + t, LayerNorm(x + t))
        if fuse_norms:
            return add_layernorm(x, t, w[name + ".weight"], w[name + ".bias"])
        x = x + t
        return x, w.layer_norm(x, name)

    x = w.linear(patchify(crops, cfg.enc_patch_size), "vision.patch_emb") + w["vision.pos_emb"]
    n, t, d = x.shape
    heads = cfg.enc_n_heads
    last = cfg.enc_n_layers - 1
    h = w.layer_norm(x, "vision.blocks.0.ln1")
    for i in range(cfg.enc_n_layers):
        p = f"vision.blocks.{i}"
        qkv = w.linear(h, p + ".attn.qkv")
        if attention == "auto":
            attention = "gluon" if takes(qkv, heads) else "sdpa"
        if attention == "triton":
            a = vision_attention(qkv, heads, attention_config)
        elif attention == "gluon":
            a = vision_attention_gluon(qkv, heads, attention_config)
        else:
            q, k, v = qkv.view(n, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x, h2 = add_norm(x, w.linear(a, p + ".attn.proj"), p + ".ln2")
        g = linear_gelu(h2, w[p + ".mlp.fc1.weight"], w[p + ".mlp.fc1.bias"])
        x, h = add_norm(x, w.linear(g, p + ".mlp.fc2"),
                        "vision.post_ln" if i == last else f"vision.blocks.{i + 1}.ln1")
        if cut is not None and i == CUT_AFTER_BLOCK:
            cut()
    return h                                 # the last block's output through post_ln


__all__ = ["ATTENTION_FORMS", "encoder"]
