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
  - RESIDUAL_GEMM (CUDA, with the fused norms): the attention output projection and fc2
    add their products into the residual stream themselves (torch.addmm over x: cuBLAS's
    beta = 1 epilogue reads x, one rounding of the fp32 sum) without their biases; the
    biases they leave out are carried apart, summed per block in fp32 (`bias_offsets`, once
    per model), and each LayerNorm reads x + that offset (ops/add_layernorm.py
    offset_layernorm: x read once, h written, the sum not stored) - the block's add +
    norm passes read / write 60 MB instead of 75 at 9 crops.
Attention: SDPA picks cuDNN for [crops, 16, 729, 72] bf16 on the H200 (3.9 ms for 27 layers,
the fastest of cuDNN / flash / efficient / math measured, docs/benchmarks.md), as before.
attention="triton" (opt-in, measured by bench/probe_encode.py before it can be a default):
ops/vision_attention.py, a Triton flash kernel that reads q / k / v straight from the qkv
GEMM output and computes head 72 as 64 + 16 columns instead of cuDNN's 128-wide tiles.
On the CPU (fp32) every op is the reference's: bit-identical to vision.encoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops._triton import HAVE_TRITON
from ...ops.add_layernorm import add_layernorm, offset_layernorm
from ...ops.linear_gelu import linear_gelu
from ...ops.vision_attention import vision_attention
from .config import VisionConfig
from .layers import Weights
from .vision import patchify


ATTENTION_FORMS = ("sdpa", "triton")
# the residual adds in the GEMMs' epilogues, the biases carried apart (see above; not yet
# measured on the GPU: off until it is)
RESIDUAL_GEMM = False


def bias_offsets(w: Weights, cfg: VisionConfig) -> list[torch.Tensor]:
    """The fp32 sums of the residual GEMMs' biases up to each block's two norms (after the
    projection, after fc2), made once per model and kept on the weights (a captured encode
    graph reads them by address)."""
    names = [f"vision.blocks.{i}.{m}.bias" for i in range(cfg.enc_n_layers)
             for m in ("attn.proj", "mlp.fc2")]
    key = tuple(w[n].data_ptr() for n in names)
    cache = w.__dict__.setdefault("_vision_bias_offsets", {})
    if key not in cache:
        c = torch.zeros_like(w[names[0]], dtype=torch.float32)
        cache.clear()
        cache[key] = [c := c + w[n].float() for n in names]
    return cache[key]


def encoder(w: Weights, cfg: VisionConfig, crops: torch.Tensor,
            fuse_norms: bool | None = None, attention: str = "sdpa",
            attention_config: tuple | None = None) -> torch.Tensor:
    """fuse_norms: each residual add and the LayerNorm after it in one Triton kernel
    (ops/add_layernorm.py); None = on CUDA when triton imports. attention: "sdpa" |
    "triton" (ops/vision_attention.py; attention_config: its (BLOCK_M, BLOCK_N, warps,
    stages))."""
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
    if fuse_norms and RESIDUAL_GEMM:
        return _encoder_residual_gemm(w, cfg, x, h, attention, attention_config)
    for i in range(cfg.enc_n_layers):
        p = f"vision.blocks.{i}"
        a = _attention(w.linear(h, p + ".attn.qkv"), n, t, d, heads, attention,
                       attention_config)
        x, h2 = add_norm(x, w.linear(a, p + ".attn.proj"), p + ".ln2")
        g = linear_gelu(h2, w[p + ".mlp.fc1.weight"], w[p + ".mlp.fc1.bias"])
        x, h = add_norm(x, w.linear(g, p + ".mlp.fc2"),
                        "vision.post_ln" if i == last else f"vision.blocks.{i + 1}.ln1")
    return h                                 # the last block's output through post_ln


def _attention(qkv, n, t, d, heads, attention, attention_config):
    if attention == "triton":
        return vision_attention(qkv, heads, attention_config)
    q, k, v = qkv.view(n, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)


def _encoder_residual_gemm(w, cfg, x, h, attention, attention_config):
    """encoder's blocks in the RESIDUAL_GEMM form (x: the embedded patches, h: its first
    LayerNorm)."""
    n, t, d = x.shape
    offsets = bias_offsets(w, cfg)
    last = cfg.enc_n_layers - 1
    x = x.reshape(n * t, d)
    for i in range(cfg.enc_n_layers):
        p = f"vision.blocks.{i}"
        a = _attention(w.linear(h, p + ".attn.qkv"), n, t, d, cfg.enc_n_heads, attention,
                       attention_config)
        x = torch.addmm(x, a.reshape(n * t, d), w[p + ".attn.proj.weight"].t())
        ln = w[p + ".ln2.weight"], w[p + ".ln2.bias"]
        h2 = offset_layernorm(x, offsets[2 * i], *ln).view(n, t, d)
        g = linear_gelu(h2, w[p + ".mlp.fc1.weight"], w[p + ".mlp.fc1.bias"])
        x = torch.addmm(x, g.reshape(n * t, -1), w[p + ".mlp.fc2.weight"].t())
        nxt = "vision.post_ln" if i == last else f"vision.blocks.{i + 1}.ln1"
        h = offset_layernorm(x, offsets[2 * i + 1], w[nxt + ".weight"], w[nxt + ".bias"]
                             ).view(n, t, d)
    return h


__all__ = ["ATTENTION_FORMS", "RESIDUAL_GEMM", "bias_offsets", "encoder"]
