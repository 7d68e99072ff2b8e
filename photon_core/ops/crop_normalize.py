"""Moondream 2's crops of a frame, cut and normalized in one pass: the global view and the
local tiles of the resized frame (models/moondream2/crops.py) -> the vision encoder's input
[n, 3, crop, crop] in the model dtype; torch reference and Triton kernel side by side.

    crop_normalize(global_view, big, tiling, window, lut, out)

global_view uint8 [crop, crop, 3] (crop 0), big uint8 [H, W, 3] or None (global only): local
crop 1 + i * cols + j is big[i * window:, j * window:] cut to crop x crop, zero past big's
edge (fill_crops). A pixel p becomes lut[p]: the 256 values of vision.normalize
(x / 255 - 0.5) / 0.5, each op rounded to the dtype as the reference does, made by that very
function from the 256 bytes (pixel_lut) - so the output is bitwise the reference's
normalize(fill_crops(...)), whatever the device's division does.

The reference (zeros, a copy per tile, then permute + cast + div + sub + div: ~15 launches
for a 640x480 frame's 9 crops) is fill_crops + vision.normalize; the kernel is one
launch that writes out (a slice of the encode graph's static input) directly.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton


@triton.jit
def _crop_normalize_kernel(g_ptr, big_ptr, lut_ptr, out_ptr, total, BIG_H, BIG_W, COLS,
                           WINDOW, CROP: tl.constexpr, HAS_BIG: tl.constexpr,
                           BLOCK: tl.constexpr):
    """out [n, 3, CROP, CROP]: one block of its elements (int32 offsets: crop_normalize
    checks the sizes)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    x = offs % CROP
    t = offs // CROP
    y = t % CROP
    t = t // CROP
    ch = t % 3
    n = t // 3
    is_global = n == 0
    pix = tl.load(g_ptr + (y * CROP + x) * 3 + ch, mask=ok & is_global, other=0)
    if HAS_BIG:
        tile = tl.maximum(n - 1, 0)
        yy = (tile // COLS) * WINDOW + y
        xx = (tile % COLS) * WINDOW + x
        inside = ok & (n > 0) & (yy < BIG_H) & (xx < BIG_W)
        local = tl.load(big_ptr + (yy * BIG_W + xx) * 3 + ch, mask=inside, other=0)
        pix = tl.where(is_global, pix, local)
    v = tl.load(lut_ptr + pix.to(tl.int32), mask=ok, other=0.0)
    tl.store(out_ptr + offs, v, mask=ok)


def pixel_lut(normalize, device, dtype) -> torch.Tensor:
    """The 256 normalized values [256] (dtype, on device) of `normalize` (vision.normalize:
    uint8 [N, H, W, 3] -> [N, 3, H, W]) applied to the bytes 0..255."""
    b = torch.arange(256, dtype=torch.uint8, device=device).view(1, 1, 256, 1).expand(
        1, 1, 256, 3).contiguous()
    return normalize(b, device, dtype)[0, 0, 0].contiguous()


def fill_crops(crops, global_view, big, tiling: tuple[int, int], window: int):
    """crops[0] = the global view, crops[1 + i*cols + j] = the crop of `big` at
    (i*window, j*window), cut at big's edge (crops stays zero there). Indexing only: numpy
    arrays and torch tensors alike (crops.overlap_crops / CropPlan's torch form)."""
    rows, cols = tiling
    crop_size = crops.shape[1]
    crops[0] = global_view
    for i in range(rows):
        for j in range(cols):
            tile = big[i * window:i * window + crop_size, j * window:j * window + crop_size]
            crops[1 + i * cols + j, :tile.shape[0], :tile.shape[1]] = tile
    return crops


def crop_normalize_reference(global_view: torch.Tensor, big: torch.Tensor | None,
                             tiling: tuple[int, int], window: int, normalize, dtype
                             ) -> torch.Tensor:
    """normalize(fill_crops(zeros, ...), device, dtype): what the kernel computes."""
    c = global_view.shape[0]
    if big is None:
        return normalize(global_view[None], global_view.device, dtype)
    crops = global_view.new_zeros((1 + tiling[0] * tiling[1], c, c, 3))
    return normalize(fill_crops(crops, global_view, big, tiling, window), global_view.device,
                     dtype)


def crop_normalize(global_view: torch.Tensor, big: torch.Tensor | None,
                   tiling: tuple[int, int], window: int, lut: torch.Tensor,
                   out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """The crops normalized by lut [256] into out [1 + rows * cols (1 when big is None), 3,
    crop, crop] (contiguous, lut's dtype; made when None), in one launch."""
    c = global_view.shape[0]
    if global_view.dtype != torch.uint8 or tuple(global_view.shape) != (c, c, 3):
        raise ValueError(f"global view: uint8 [crop, crop, 3] expected, got "
                         f"{global_view.dtype} {tuple(global_view.shape)}")
    if big is not None and (big.dtype != torch.uint8 or big.dim() != 3 or big.shape[2] != 3):
        raise ValueError(f"big: uint8 [H, W, 3] expected, got {big.dtype} {tuple(big.shape)}")
    n = 1 + (tiling[0] * tiling[1] if big is not None else 0)
    if out is None:
        out = torch.empty((n, 3, c, c), dtype=lut.dtype, device=global_view.device)
    if tuple(out.shape) != (n, 3, c, c) or not out.is_contiguous() or out.dtype != lut.dtype:
        raise ValueError(f"out: contiguous {lut.dtype} {(n, 3, c, c)} expected, got "
                         f"{out.dtype} {tuple(out.shape)}")
    g = global_view.contiguous()
    b = big.contiguous() if big is not None else g
    total = out.numel()
    if max(total, b.numel()) >= 2 ** 31:
        raise ValueError("crops or images of 2^31 elements or more are not supported")
    _crop_normalize_kernel[(triton.cdiv(total, block),)](
        g, b, lut, out, total, b.shape[0], b.shape[1], tiling[1] if big is not None else 1,
        window, CROP=c, HAS_BIG=big is not None, BLOCK=block, num_warps=4)
    return out


__all__ = ["crop_normalize", "crop_normalize_reference", "fill_crops", "pixel_lut"]
