"""The vision encoder with fewer passes over memory: vision.encoder's math, for the runtime's
encode (EngineOptions.encoder = "fast"; the reference stays vision.encoder).

Differences, each an equivalent form (close, not bitwise, in bf16 on CUDA):
  - the MLP's fc1 + tanh-GELU is one GEMM with a GELU epilogue (ops/linear_gelu.py: no
    second pass over the [crops*729, 4304] intermediate); on the CPU the reference form;
  - q, k, v are strided views of the fused qkv GEMM's output ([n, t, 3, heads, hd] permuted)
    handed to SDPA as they are (vision.encoder's chunk + view + transpose gives the same
    views; kept here for clarity), and the attention output's [n, heads, t, hd] ->
    [n, t, d] copy is the one transpose+reshape.
Attention: SDPA picks cuDNN for [crops, 16, 729, 72] bf16 on the H200 (3.9 ms for 27 layers,
the fastest of cuDNN / flash / efficient / math measured, docs/benchmarks.md), as before.
On the CPU (fp32) every op is the reference's: bit-identical to vision.encoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.linear_gelu import linear_gelu
from .config import VisionConfig
from .layers import Weights
from .vision import patchify


def encoder(w: Weights, cfg: VisionConfig, crops: torch.Tensor) -> torch.Tensor:
    x = w.linear(patchify(crops, cfg.enc_patch_size), "vision.patch_emb") + w["vision.pos_emb"]
    n, t, d = x.shape
    heads = cfg.enc_n_heads
    for i in range(cfg.enc_n_layers):
        p = f"vision.blocks.{i}"
        h = w.layer_norm(x, p + ".ln1")
        qkv = w.linear(h, p + ".attn.qkv").view(n, t, 3, heads, d // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + w.linear(a, p + ".attn.proj")
        g = linear_gelu(w.layer_norm(x, p + ".ln2"), w[p + ".mlp.fc1.weight"],
                        w[p + ".mlp.fc1.bias"])
        x = x + w.linear(g, p + ".mlp.fc2")
    return w.layer_norm(x, "vision.post_ln")


__all__ = ["encoder"]
