"""Turning what callers pass (numpy RGB, PIL image, file path) into an HxWx3 uint8 array.

Bad inputs raise ImageError (a ValueError) that says what is wrong. Images larger than
MAX_SIDE on their long side are shrunk first (integer decimation, then a Lanczos resize), so a
16k x 16k frame costs a couple of seconds on a CPU, not a crash; the tiling could not use more
than ~3.3k pixels per side anyway (12 crops of 266 px). Such images therefore differ slightly
from the reference, which resizes the full-size image directly; up to MAX_SIDE they are the same.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

MAX_SIDE = 4096


class ImageError(ValueError):
    """An image that cannot be used as given."""


def _shrink(image: np.ndarray, max_side: int) -> np.ndarray:
    h, w = image.shape[:2]
    if max(h, w) <= max_side:
        return image
    step = max(h, w) // (2 * max_side)   # decimate down to within 2x of the target
    if step > 1:
        image = image[::step, ::step]
    image = np.ascontiguousarray(image)
    h, w = image.shape[:2]
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(image).resize(size, Image.Resampling.LANCZOS))


def _from_pil(img: Image.Image, max_side: int) -> np.ndarray:
    if img.width == 0 or img.height == 0:
        raise ImageError(f"image is empty ({img.width}x{img.height})")
    if max(img.size) > max_side:
        factor = max(img.size) // max_side
        if factor > 1:
            img = img.reduce(factor)
    return np.asarray(img.convert("RGB"))


def to_rgb_array(image, max_side: int = MAX_SIDE) -> np.ndarray:
    """numpy HxWx3 uint8 RGB | PIL.Image | path -> contiguous HxWx3 uint8, long side <= max_side."""
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ImageError(f"image file not found: {path}")
        try:
            with Image.open(path) as img:
                img.draft("RGB", (max_side, max_side))   # JPEG: decode at reduced size
                array = _from_pil(img, max_side)
        except Image.DecompressionBombError as e:
            raise ImageError(f"image file {path} is too large to decode: {e}") from None
        except (OSError, SyntaxError) as e:
            raise ImageError(f"cannot read image file {path}: {e}") from None
    elif isinstance(image, Image.Image):
        array = _from_pil(image, max_side)
    elif isinstance(image, np.ndarray):
        array = image
        if array.ndim != 3 or array.shape[2] != 3:
            raise ImageError(f"image array must be HxWx3 RGB, got shape {array.shape}")
        if array.dtype != np.uint8:
            raise ImageError(f"image array must be uint8, got {array.dtype}")
    else:
        raise ImageError(f"unsupported image type {type(image).__name__}; pass a numpy HxWx3 "
                         "uint8 RGB array, a PIL image or a file path")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"image is empty ({array.shape[1]}x{array.shape[0]})")
    return np.ascontiguousarray(_shrink(array, max_side))
