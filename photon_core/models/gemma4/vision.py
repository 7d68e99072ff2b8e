"""The Gemma 4 vision tower (reference) and its image preprocessing.

Preprocess (as transformers' Gemma4ImageProcessor): resize with PIL bicubic, keeping the
aspect ratio, to the largest size whose sides are multiples of pool * patch and whose patch
count is at most max_soft_tokens * pool^2; pixels / 255; cut into patch x patch patches in
row-major order, each flattened as (row, column, channel); position of a patch = (x, y).

Tower: 2(x - 0.5) -> linear patch embedding + pos_table[0][x] + pos_table[1][y];
bidirectional blocks (sandwich RMSNorms; q/k RMSNorm, scale-free v norm, 2D axial rotary:
the first half of each head turns with x, the second with y, theta 100; scale 1.0; gated
GELU MLP); average pooling over pool x pool patches (row-major over cells), x sqrt(hidden)
in fp32 (optional standardization); then into the text width: scale-free RMSNorm, linear.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from PIL import Image

from ...ops.gelu_tanh_gate import gelu_tanh_gate
from ...ops.rmsnorm_scaled import rmsnorm_scaled
from ...ops.rotary_half import axial_rotary, cos_sin, inv_freq
from .config import VisionCfg
from .weights import vision_layer

DEFAULT_SOFT_TOKENS = 280          # the image processor's default budget
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)   # the budgets the model was trained with


def target_size(height: int, width: int, patch: int, pool: int, max_soft_tokens: int) -> tuple[int, int]:
    """(h, w): the largest aspect-preserving size with sides multiple of pool*patch and at
    most max_soft_tokens * pool^2 patches (a side that would round to 0 becomes one cell)."""
    side = pool * patch
    max_patches = max_soft_tokens * pool * pool
    f = math.sqrt(max_patches * patch * patch / (height * width))
    th, tw = int(f * height // side) * side, int(f * width // side) * side
    if th == 0 and tw == 0:
        raise ValueError(f"image {width}x{height} is too thin to make one {side}-pixel cell")
    longest = (max_patches // (pool * pool)) * side
    if th == 0:
        th, tw = side, min(int(width // height) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(height // width) * side, longest)
    return th, tw


def preprocess(rgb: np.ndarray, cfg: VisionCfg, max_soft_tokens: int = DEFAULT_SOFT_TOKENS):
    """HxWx3 uint8 -> (patches [N, 3 p^2] fp32, positions [N, 2] (x, y), (rows, cols))."""
    p = cfg.patch_size
    h, w = rgb.shape[:2]
    th, tw = target_size(h, w, p, cfg.pool, max_soft_tokens)
    if (th, tw) != (h, w):
        rgb = np.asarray(Image.fromarray(rgb).resize((tw, th), Image.BICUBIC))
    x = torch.from_numpy(np.array(rgb, dtype=np.uint8)).float() / 255.0    # [H, W, 3], a copy
    rows, cols = th // p, tw // p
    return _patch_order(x, p), grid_positions(rows, cols), (rows, cols)


def _patch_order(x: torch.Tensor, p: int) -> torch.Tensor:
    """[H, W, 3] -> [rows * cols, p * p * 3]: row-major patches, each (row, column, channel)."""
    rows, cols = x.shape[0] // p, x.shape[1] // p
    return x.view(rows, p, cols, p, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)


def grid_positions(rows: int, cols: int, device=None) -> torch.Tensor:
    """[rows * cols, 2] (x, y) of the row-major patches."""
    ys, xs = torch.meshgrid(torch.arange(rows, device=device),
                            torch.arange(cols, device=device), indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)


def pixel_table() -> torch.Tensor:
    """[256] fp32: every uint8 value / 255 by preprocess's own op (on the CPU)."""
    return torch.arange(256, dtype=torch.uint8).float() / 255.0


def patches_torch(image: torch.Tensor, table: torch.Tensor, p: int) -> torch.Tensor:
    """preprocess's patches from the resized uint8 image [H, W, 3] on its device, bit for bit:
    a lookup in pixel_table (moved to that device) and data movement. The engine's encode
    resizes on the device first (photon_core/pil_resize.py, PIL's BICUBIC pixels)."""
    return _patch_order(table[image.long()], p)


def _linear(w, cfg: VisionCfg, j: int, name: str, x: torch.Tensor) -> torch.Tensor:
    if cfg.clipped_linears:
        x = x.clamp(w[vision_layer(j, name + ".input_min")], w[vision_layer(j, name + ".input_max")])
    y = x @ w[vision_layer(j, name + ".linear.weight")].T
    if cfg.clipped_linears:
        y = y.clamp(w[vision_layer(j, name + ".output_min")], w[vision_layer(j, name + ".output_max")])
    return y


def _attention(w, cfg: VisionCfg, j: int, h: torch.Tensor, rot) -> torch.Tensor:
    N, D = h.shape[0], cfg.head_dim
    q = _linear(w, cfg, j, "self_attn.q_proj", h).view(N, -1, D)
    k = _linear(w, cfg, j, "self_attn.k_proj", h).view(N, -1, D)
    v = _linear(w, cfg, j, "self_attn.v_proj", h).view(N, -1, D)
    q = axial_rotary(rmsnorm_scaled(q, w[vision_layer(j, "self_attn.q_norm.weight")], cfg.eps), *rot)
    k = axial_rotary(rmsnorm_scaled(k, w[vision_layer(j, "self_attn.k_norm.weight")], cfg.eps), *rot)
    v = rmsnorm_scaled(v, None, cfg.eps)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    probs = torch.softmax((q @ k.transpose(1, 2)).float(), dim=-1).to(q.dtype)   # scale 1.0
    a = (probs @ v).transpose(0, 1).reshape(N, -1)
    return _linear(w, cfg, j, "self_attn.o_proj", a)


def _block(w, cfg: VisionCfg, j: int, x: torch.Tensor, rot) -> torch.Tensor:
    def norm(t, name):
        return rmsnorm_scaled(t, w[vision_layer(j, name + ".weight")], cfg.eps)

    x = x + norm(_attention(w, cfg, j, norm(x, "input_layernorm"), rot), "post_attention_layernorm")
    h = norm(x, "pre_feedforward_layernorm")
    m = _linear(w, cfg, j, "mlp.down_proj",
                gelu_tanh_gate(_linear(w, cfg, j, "mlp.gate_proj", h), _linear(w, cfg, j, "mlp.up_proj", h)))
    return x + norm(m, "post_feedforward_layernorm")


@functools.lru_cache(maxsize=16)
def _inv_freq_on(device: torch.device, dim: int, theta: float) -> torch.Tensor:
    """inv_freq computed on the host (as always) and kept on the patches' device: the values
    cos_sin would copy there on every call, copied once (a CUDA graph capture of the tower
    may copy nothing from pageable host memory)."""
    return inv_freq(dim, theta).to(device)


def tower(w, cfg: VisionCfg, patches: torch.Tensor, positions: torch.Tensor,
          grid: tuple[int, int], block=None, rotary=None) -> torch.Tensor:
    """-> pooled soft tokens [rows/pool * cols/pool, vision hidden] (fp32, x sqrt(hidden)).
    block(j, x, rot) -> x: a block's forward other than _block's (vision_fast.FastTower);
    rotary(cx, sx, cy, sy) -> rot: the form of the rotary tables the blocks get (default
    the tuple of the four)."""
    dtype = w["vision_tower.patch_embedder.input_proj.weight"].dtype
    table = w["vision_tower.patch_embedder.position_embedding_table"]
    x = (2 * (patches - 0.5)).to(dtype) @ w["vision_tower.patch_embedder.input_proj.weight"].T
    x = x + table[0][positions[:, 0]] + table[1][positions[:, 1]]
    f = _inv_freq_on(positions.device, cfg.head_dim // 2, cfg.rope_theta)
    cx, sx = cos_sin(positions[:, 0], f, x.dtype)
    cy, sy = cos_sin(positions[:, 1], f, x.dtype)
    rot = rotary(cx, sx, cy, sy) if rotary else (cx, sx, cy, sy)
    for j in range(cfg.n_layers):
        x = block(j, x, rot) if block else _block(w, cfg, j, x, rot)
    rows, cols = grid
    k = cfg.pool
    pooled = x.float().view(rows // k, k, cols // k, k, -1).mean(dim=(1, 3)).reshape(-1, x.shape[-1])
    pooled = pooled * cfg.hidden ** 0.5
    if cfg.standardize:
        pooled = (pooled - w["vision_tower.std_bias"].float()) * w["vision_tower.std_scale"].float()
    return pooled.to(dtype)


def project(w, cfg: VisionCfg, soft: torch.Tensor) -> torch.Tensor:
    """Soft tokens -> text width (scale-free RMSNorm, linear)."""
    return rmsnorm_scaled(soft, None, cfg.eps) @ w["embed_vision.embedding_projection.weight"].T


def encode(w, cfg: VisionCfg, patches, positions, grid, fast_tower=None) -> torch.Tensor:
    """Soft tokens in the text width; fast_tower (vision_fast.FastTower): its tower instead
    of the reference's."""
    dev = w["vision_tower.patch_embedder.input_proj.weight"].device
    patches, positions = patches.to(dev), positions.to(dev)
    soft = fast_tower(patches, positions, grid) if fast_tower is not None else \
        tower(w, cfg, patches, positions, grid)
    return project(w, cfg, soft)
