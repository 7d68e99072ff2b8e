"""Overlap-crop tiling of an image, and stitching the per-crop features back together.

A crop is `crop_size` (378) pixels = `grid` (27) patches. Neighbouring local crops overlap by
`overlap_margin` (4) patches on each side, so each crop contributes a central window of
(27 - 2*4) * 14 = 266 pixels. The image is resized so that a (rows, cols) grid of windows plus
one margin on each outer edge covers it exactly; crop (i, j) starts at (i*266, j*266).
Crop 0 is the global view: the whole image resized to 378 x 378.

Both resizes are PIL's LANCZOS: overlap_crops runs PIL on the CPU, overlap_crops_tensor
runs the bit-identical torch version (photon_core/pil_resize.py) on the tensor's device.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from ...encode_request import crop_budget
from ...ops.crop_normalize import crop_normalize, fill_crops
from ...pil_resize import ResizePlan

# the on-device crops (model.device_crops) on CUDA cut and normalized by one Triton launch
# (CropPlan.normalized, ops/crop_normalize.py) instead of ~15 torch ops
TRITON_CROPS = True


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """How many (rows, cols) of `window`-sized tiles cover height x width, at most max_crops.

    Rules (same as the reference): an image no larger than one window in either direction
    gets (1, 1). Otherwise start from the minimum tiles that cover each side; if that is
    already over budget, shrink both proportionally. Else aim for the tiling whose tiles are
    square-ish (rows ~ sqrt(max_crops * h / w)), at least the minimum, and if that overshoots
    the budget cut the larger count down to fit.
    """
    if height <= window or width <= window:
        return (1, 1)
    min_h, min_w = math.ceil(height / window), math.ceil(width / window)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if rows * cols > max_crops:
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return (max(1, rows), max(1, cols))


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))


_resize_pool: ThreadPoolExecutor | None = None


def _resize_in_background(image: np.ndarray, height: int, width: int) -> Future:
    """PIL releases the GIL while resampling: the global view's resize runs on a helper
    thread while the caller resizes the big image (same pixels; ~5 ms less per 640x480
    frame, measured on 2 cores)."""
    global _resize_pool
    if _resize_pool is None:
        _resize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="photon-resize")
    return _resize_pool.submit(_resize, image, height, width)


def crops_layout(height: int, width: int, crop_size: int, patch: int, margin: int,
                 max_crops: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Tiling (rows, cols) of a height x width image, and the (height, width) the image is
    resized to before the local crops are cut from it."""
    margin_px = margin * patch
    window = crop_size - 2 * margin_px
    rows, cols = select_tiling(height - 2 * margin_px, width - 2 * margin_px, window,
                               max_crops)
    return (rows, cols), (rows * window + 2 * margin_px, cols * window + 2 * margin_px)


def overlap_crops(image: np.ndarray, crop_size: int, patch: int, margin: int,
                  max_crops: int) -> tuple[np.ndarray, tuple[int, int]]:
    """HxWx3 uint8 -> (crops [1 + rows*cols, crop, crop, 3] uint8, (rows, cols)), with PIL."""
    tiling, (big_h, big_w) = crops_layout(*image.shape[:2], crop_size, patch, margin,
                                          max_crops)
    crops = np.zeros((1 + tiling[0] * tiling[1], crop_size, crop_size, 3), dtype=np.uint8)
    global_view = _resize_in_background(image, crop_size, crop_size)
    big = _resize(image, big_h, big_w)
    fill_crops(crops, global_view.result(), big, tiling, crop_size - 2 * margin * patch)
    return crops, tiling


def overlap_crops_tensor(image: torch.Tensor, crop_size: int, patch: int, margin: int,
                         max_crops: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """overlap_crops on a uint8 [H, W, 3] tensor, on its device (pil_resize: the same
    pixels as PIL) -> (crops [1 + rows*cols, crop, crop, 3] uint8 tensor, (rows, cols))."""
    plan = CropPlan(image.shape[0], image.shape[1], "overlap", crop_size, patch, margin,
                    max_crops, image.device)
    return plan(image), plan.tiling


# The tiling of a global-only encode (EncodeRequest crops="global"): the global view's
# features stand in for a one-crop local grid, as for an image that fits one crop (there the
# local crop, resized to 266 + 2 * 56 = 378 px, is the global view itself).
GLOBAL_TILING = (1, 1)


def global_crop(image: np.ndarray, crop_size: int) -> np.ndarray:
    """HxWx3 uint8 -> the global view alone, [1, crop, crop, 3] uint8 (PIL LANCZOS): crop 0
    of overlap_crops."""
    return np.array(_resize(image, crop_size, crop_size))[None]


def global_crop_tensor(image: torch.Tensor, crop_size: int) -> torch.Tensor:
    """global_crop on a uint8 [H, W, 3] tensor, on its device (the same pixels as PIL)."""
    return CropPlan(image.shape[0], image.shape[1], "global", crop_size, 1, 0, 1,
                    image.device)(image)


def crop_geometry(height: int, width: int, mode: str, crop_size: int, patch: int,
                  margin: int, max_crops: int
                  ) -> tuple[tuple[int, int], int, tuple[int, int] | None]:
    """(tiling, crops the vision encoder runs, the (height, width) the local crops are cut
    from or None) of a height x width frame in crop mode `mode`, without any pixel work."""
    if mode == "global":
        return GLOBAL_TILING, 1, None
    tiling, big = crops_layout(height, width, crop_size, patch, margin,
                               crop_budget(mode, max_crops))      # ValueError: unknown mode
    return tiling, 1 + tiling[0] * tiling[1], big


class CropPlan:
    """The torch crops of uint8 [height, width, 3] frames in one crop mode on one device:
    overlap_crops_tensor ("overlap", "overlap:N") or global_crop_tensor ("global"), their resizes'
    tables put on the device when the plan is made, so that calling it launches tensor ops
    only (no host->device copy, no host sync): the graphed encoder runs it inside its CUDA
    graph (fast/graphed_batch_encoder.py). tiling / n_crops: the frame's, known without
    computing any crop."""

    def __init__(self, height: int, width: int, mode: str, crop_size: int, patch: int,
                 margin: int, max_crops: int, device):
        self.shape, self.mode, self.crop_size = (int(height), int(width)), mode, crop_size
        self.tiling, self.n_crops, big = crop_geometry(height, width, mode, crop_size, patch,
                                                       margin, max_crops)
        self.global_view = ResizePlan(height, width, crop_size, crop_size, device)
        self.big = None if big is None else ResizePlan(height, width, *big, device)
        self.window = crop_size - 2 * margin * patch

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 [height, width, 3] -> uint8 crops [n_crops, crop, crop, 3]."""
        if self.big is None:
            return self.global_view(image)[None]
        c = self.crop_size
        crops = image.new_zeros((self.n_crops, c, c, 3))
        return fill_crops(crops, self.global_view(image), self.big(image), self.tiling,
                          self.window)

    def normalized(self, image: torch.Tensor, lut: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [height, width, 3] -> the crops normalized by lut (ops/crop_normalize.py's
        pixel_lut of vision.normalize) [n_crops, 3, crop, crop], cut and normalized in one
        Triton launch into out (made when None): bitwise normalize(self(image))."""
        return crop_normalize(self.global_view(image),
                              None if self.big is None else self.big(image), self.tiling,
                              self.window, lut, out)


def stitch_features(local: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """[rows*cols, g, g, C] per-crop patch features -> one [H, W, C] feature map.

    Each crop keeps only its central window, except that crops on the outer border also keep
    the margin on their outer side, so H = (g - 2m) * rows + 2m (likewise W).
    """
    rows, cols = tiling
    n, g, _, c = local.shape
    step = g - 2 * margin
    out = local.new_zeros(step * rows + 2 * margin, step * cols + 2 * margin, c)
    for k in range(n):
        i, j = divmod(k, cols)
        y0 = 0 if i == 0 else margin
        y1 = g if i == rows - 1 else g - margin
        x0 = 0 if j == 0 else margin
        x1 = g if j == cols - 1 else g - margin
        out[i * step + y0:i * step + y1, j * step + x0:j * step + x1] = local[k, y0:y1, x0:x1]
    return out
