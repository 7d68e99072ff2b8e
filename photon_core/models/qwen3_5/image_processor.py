"""Qwen 3.5's image preprocessing (Qwen2-VL rules) with PIL and numpy, no torchvision.

1. smart_resize: both sides rounded to a multiple of factor = patch_size * merge_size (32),
   then scaled (keeping the aspect ratio) into [min_pixels, max_pixels] when outside.
2. PIL bicubic resize of the uint8 RGB image; /255; (x - mean) / std per channel.
3. Patches of patch_size x patch_size, ordered by 2x2 merge blocks (block row, block col, row
   in block, col in block), each flattened as (channel, time, y, x) with the single frame
   repeated temporal_patch_size times: -> [gh * gw, C * T * P * P], grid (1, gh, gw).

`preprocess` does all three on the host (the reference's form). The engine's encode sends the
uint8 frame to the device as it is and does all three there: the resize to `resized_size` by
photon_core/pil_resize.py (PIL's BICUBIC pixels bit for bit), then `patches_torch`: the
normalization as a lookup in `normalize_table` (every uint8 value normalized by the same fp32
numpy ops as preprocess) and the patch order as data movement - preprocess's patches bit for
bit on any device, with no host pass over the pixels and an eighth of the bytes to copy (a
640x480 frame: 0.9 MB instead of 7.4 MB).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ImageProcessorConfig":
        d = d or {}
        size = d.get("size") or {}
        kw = {k: d[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in d}
        mn = d.get("min_pixels", size.get("shortest_edge"))
        mx = d.get("max_pixels", size.get("longest_edge"))
        if mn is not None:
            kw["min_pixels"] = int(mn)
        if mx is not None:
            kw["max_pixels"] = int(mx)
        for k in ("image_mean", "image_std"):
            if k in d:
                kw[k] = tuple(float(x) for x in d[k])
        return cls(**kw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is "
                         "over 200, which Qwen 3.5 does not accept")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Step 1: the (h, w) an image of this size is resized to (smart_resize with the
    processor's factor and pixel budget); the grid is (1, h / patch, w / patch)."""
    return smart_resize(height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels,
                        cfg.max_pixels)


def resize_to_grid(image: np.ndarray, cfg: ImageProcessorConfig
                   ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Step 1 and the resize of step 2: HxWx3 uint8 RGB -> (uint8 image of the grid's size,
    grid (1, gh, gw)). (The model resizes on the device instead: photon_core/pil_resize.py's
    BICUBIC, PIL's pixels bit for bit.)"""
    p = cfg.patch_size
    h, w = resized_size(image.shape[0], image.shape[1], cfg)
    if (h, w) != image.shape[:2]:
        image = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC))
    return image, (1, h // p, w // p)


def _normalize(x: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """Step 2's arithmetic on uint8 values (any shape, channels last)."""
    x = x.astype(np.float32) * np.float32(1 / 255)
    return (x - np.array(cfg.image_mean, np.float32)) / np.array(cfg.image_std, np.float32)


def normalize_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """[256, 3] float32: every uint8 value normalized for each channel (the same ops)."""
    return _normalize(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1), cfg)


def preprocess(image: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """HxWx3 uint8 RGB -> (patches [gh*gw, C*T*P*P] float32, grid (1, gh, gw))."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    image, grid = resize_to_grid(image, cfg)
    x = _normalize(image, cfg).transpose(2, 0, 1)                # [C, H, W]
    c = x.shape[0]
    gh, gw = grid[1], grid[2]
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p)), grid


def patches_torch(image: torch.Tensor, table: torch.Tensor, cfg: ImageProcessorConfig
                  ) -> torch.Tensor:
    """Steps 2-3 on image's device: image [H, W, 3] uint8 (resized), table [256, 3]
    (normalize_table's) -> preprocess's patches, bit for bit: a lookup and data movement."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w, c = image.shape
    x = table[image.long(), torch.arange(c, device=image.device)].permute(2, 0, 1)
    gh, gw = h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)
    return x.reshape(gh * gw, c * t * p * p)
