"""SigLIP-style vision encoder and the projection into the text model's space.

crops [N, 3, 378, 378] -> 14x14 patches (588 values each, channel-major) -> linear to 1152
+ learned position embedding -> 27 pre-LN blocks (LayerNorm, MHA with fused qkv, tanh-GELU
MLP) -> LayerNorm. Features [N, 729, 1152].

Projection: the local crops' features are stitched into one map (crops.stitch_features),
average-pooled back to 27x27, concatenated channel-wise with the global crop's features
(2 x 1152) and sent through the 2-layer MLP to 729 tokens of text width.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import VisionConfig
from .crops import stitch_features
from .layers import Weights


def normalize(crops: np.ndarray | torch.Tensor, device, dtype) -> torch.Tensor:
    """uint8 [N, H, W, 3] (numpy or tensor) -> [N, 3, H, W] on device, pixels mapped to
    (x/255 - 0.5) / 0.5 in [-1, 1].

    Each of the three operations rounds to `dtype`, in that order, as the reference does:
    in bf16 this differs from computing in fp32 and rounding once."""
    if isinstance(crops, np.ndarray):
        crops = torch.from_numpy(crops)
    x = crops.to(device).permute(0, 3, 1, 2).to(dtype)
    return x.div(255.0).sub(0.5).div(0.5)


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, C, H, W] -> [N, (H/p)*(W/p), C*p*p], patches row-major, values (c, py, px)."""
    n, c, h, w = x.shape
    x = x.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // patch) * (w // patch), c * patch * patch)


def encoder(w: Weights, cfg: VisionConfig, crops: torch.Tensor) -> torch.Tensor:
    x = w.linear(patchify(crops, cfg.enc_patch_size), "vision.patch_emb") + w["vision.pos_emb"]
    n, t, d = x.shape
    heads = cfg.enc_n_heads
    for i in range(cfg.enc_n_layers):
        p = f"vision.blocks.{i}"
        h = w.layer_norm(x, p + ".ln1")
        q, k, v = (z.view(n, t, heads, d // heads).transpose(1, 2)
                   for z in w.linear(h, p + ".attn.qkv").chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + w.linear(a, p + ".attn.proj")
        x = x + w.mlp(w.layer_norm(x, p + ".ln2"), p + ".mlp")
    return w.layer_norm(x, "vision.post_ln")


def project(w: Weights, cfg: VisionConfig, features: torch.Tensor,
            tiling: tuple[int, int]) -> torch.Tensor:
    """features [1 + rows*cols, g*g, C] -> image tokens [g*g, text dim]."""
    return w.mlp(projection_input(cfg, features, tiling), "vision.proj_mlp")


def projection_input(cfg: VisionConfig, features: torch.Tensor,
                     tiling: tuple[int, int]) -> torch.Tensor:
    """What the projection MLP reads: [global crop's features | pooled stitched local
    features], [g*g, 2C] (batched_encode.py stacks several frames' before one MLP)."""
    g, c = cfg.grid, cfg.enc_dim
    local = features[1:].reshape(-1, g, g, c)
    stitched = stitch_features(local, tiling, cfg.overlap_margin)        # [H, W, C]
    pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g))   # [C, g, g]
    pooled = pooled.permute(1, 2, 0).reshape(g * g, c)
    return torch.cat([features[0], pooled], dim=-1)
