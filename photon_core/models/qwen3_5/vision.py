"""Qwen 3.5 vision tower: patches -> merged image tokens in the text model's width.

  patch embed   Conv3d with kernel = stride = (T, P, P) == a linear map of each flattened
                (C, T, P, P) patch
  + positions   the learned side x side table, bilinearly resized (align_corners) to the
                image's gh x gw grid, in the patches' 2x2-merge-block order
  blocks        pre-LayerNorm (eps 1e-6) ViT blocks: bidirectional attention with 2D rotary
                (per head: first half of the frequencies from the row, second from the
                column, rotate-half), MLP fc2(gelu_tanh(fc1))
  merger        LayerNorm per patch, then each 2x2 block's 4 patches concatenated ->
                fc2(gelu(fc1)) -> [gh/2 * gw/2, text hidden]
Weights are read by their Hugging Face names (model.visual.*).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.mrope import rotate_half
from .config import VisionConfig

V = "model.visual."


def position_table(w: dict, cfg: VisionConfig, gh: int, gw: int) -> torch.Tensor:
    """The learned position table resized to gh x gw, in merge-block order -> [gh*gw, C]."""
    side, m = cfg.grid_side, cfg.spatial_merge_size
    table = w[V + "pos_embed.weight"].float().reshape(side, side, -1).permute(2, 0, 1)[None]
    grid = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=True)[0]
    c = grid.shape[0]
    grid = grid.reshape(c, gh // m, m, gw // m, m).permute(1, 3, 2, 4, 0)
    return grid.reshape(gh * gw, c)


def rotary(cfg: VisionConfig, gh: int, gw: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """2D rotary cos/sin [gh*gw, head_dim] for the patches in merge-block order."""
    m = cfg.spatial_merge_size
    rows = torch.arange(gh, device=device)[:, None].expand(gh, gw)
    cols = torch.arange(gw, device=device)[None, :].expand(gh, gw)
    order = lambda x: x.reshape(gh // m, m, gw // m, m).transpose(1, 2).reshape(-1)
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
    f = torch.cat([order(rows)[:, None] * inv, order(cols)[:, None] * inv], dim=-1)
    f = torch.cat([f, f], dim=-1)
    return f.cos(), f.sin()


def _ln(w, x, name):
    return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], eps=1e-6)


def _lin(w, x, name):
    return F.linear(x, w[name + ".weight"], w[name + ".bias"])


def block(w: dict, cfg: VisionConfig, i: int, x: torch.Tensor, cos, sin) -> torch.Tensor:
    p = f"{V}blocks.{i}."
    n, h = x.shape[0], cfg.num_heads
    qkv = _lin(w, _ln(w, x, p + "norm1"), p + "attn.qkv").reshape(n, 3, h, -1).permute(1, 2, 0, 3)
    q, k, v = qkv[0], qkv[1], qkv[2]                                  # [H, N, D]
    q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
    k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
    # bidirectional; [1, H, N, D]: SDPA's fused kernels take 4-D inputs only - given [H, N, D]
    # it fell back to the math form, fp32 scores and softmax: ~3.9 ms of the 0.8B model's
    # 640x480 encode on the H200, 12 layers (session 16, bench/probe_encode_ops.py)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    x = x + _lin(w, a.transpose(0, 1).reshape(n, -1), p + "attn.proj")
    y = F.gelu(_lin(w, _ln(w, x, p + "norm2"), p + "mlp.linear_fc1"), approximate="tanh")
    return x + _lin(w, y, p + "mlp.linear_fc2")


def grid_tables(w: dict, cfg: VisionConfig, grid: tuple[int, int, int], device, dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What encode adds per grid, the same for every frame of that grid: the resized
    position table (in dtype) and the rotary cos / sin. (The model keeps them per grid: the
    bilinear resize alone took 1.6 ms of a 640x480 frame's encode on the H200.)"""
    _, gh, gw = grid
    return (position_table(w, cfg, gh, gw).to(device=device, dtype=dtype),
            *rotary(cfg, gh, gw, device))


def encode(w: dict, cfg: VisionConfig, patches: torch.Tensor, grid: tuple[int, int, int],
           tables: tuple | None = None) -> torch.Tensor:
    """patches [gh*gw, C*T*P*P] (image_processor order), grid (1, gh, gw) -> [gh*gw/4, D_text];
    tables: grid_tables(...) of this grid (made here when None)."""
    pw = w[V + "patch_embed.proj.weight"]
    x = F.linear(patches.to(pw.dtype), pw.reshape(pw.shape[0], -1), w[V + "patch_embed.proj.bias"])
    pos, cos, sin = tables or grid_tables(w, cfg, grid, x.device, x.dtype)
    x = x + pos
    for i in range(cfg.depth):
        x = block(w, cfg, i, x, cos, sin)
    x = _ln(w, x, V + "merger.norm").reshape(-1, x.shape[-1] * cfg.spatial_merge_size ** 2)
    return _lin(w, F.gelu(_lin(w, x, V + "merger.linear_fc1")), V + "merger.linear_fc2")
