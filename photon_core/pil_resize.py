"""PIL's LANCZOS and BICUBIC resizes of 8-bit images in torch, bit-identical to `Image.resize`
(Moondream 2's crops resize with LANCZOS; Qwen 3.5's and Gemma 4's image processors with
BICUBIC: all three run it on the GPU, inside their encode graphs).

Pillow (libImaging/Resample.c) resizes in two separable passes, one per axis (order: see
below), each rounding to uint8 (the intermediate image is uint8). A pass computes, for
every output position, a small filter over consecutive input positions:

* coefficients, in C doubles: scale = in/out, filterscale = max(scale, 1),
  support = filter support (LANCZOS 3, BICUBIC 2) * filterscale; output xx is centred at
  (xx + 0.5) * scale and reads inputs xmin .. xmin + n - 1 (xmin = int(center - support +
  0.5) clipped to 0, the end likewise clipped to the image); tap x weighs
  filter((x + xmin - center + 0.5) / filterscale) with lanczos(t) = sinc(t) * sinc(t / 3) on
  [-3, 3), bicubic(t) = the cubic convolution with a = -0.5 on (-2, 2); the taps are divided
  by their sum.
* fixed point: each weight becomes the int32 round(w * 2^22) (halves away from zero, via
  C's truncating cast), and an output is acc = 2^21 + sum(pixel * weight) in int32,
  stored as clamp(acc >> 22, 0, 255), i.e. rounded to nearest.

The coefficient tables are computed here exactly as the C does (the same IEEE double
operations in the same order, libm's sin through `math.sin`, sums accumulated left to
right) once per (filter, input size, output size) and cached; the passes are integer ops on
the image's device (torch ops; on CUDA one Triton launch per pass, ops/resample_pass.py: the
same integer arithmetic, the same bytes). Products and sums are int32 as in the C, so even
an overflow would wrap alike; none occurs: it needs sum|w| >= 2.006 (255 * sum|w| * 2^22 + 2^21 >= 2^31), and
sum|w| is at most 1.5715 (LANCZOS) / 1.269 (BICUBIC) over all (in, out) sizes 1..159
(test_pil_resize.py). A ResizePlan holds one resize's
tables on the device, so that running it needs no host->device copy (CUDA graph capture:
fast/graphed_batch_encoder.py).

Resize along an axis whose size is unchanged is skipped, as Pillow skips it. (When the
horizontal pass goes first Pillow runs it only over the rows the vertical pass reads; the
other rows are never read, so resampling them all here changes nothing.)

Pass order. The passes do not commute (each rounds to uint8), and Pillow's order depends
on its version: before 12.2 always horizontal first; 12.2 and 12.x do a tall image
(H > 100 W) that shrinks vertically vertical first; from 13.0 vertical goes first whenever
the height shrinks by more than twice as many pixels as the width does. `_vertical_first`
follows the installed Pillow (the tests compare against it, so a new rule would show).

Matches PIL for modes L (C = 1) and RGB (C = 3): every band is filtered on its own.
(PIL premultiplies alpha for RGBA/LA, which this does not do.)
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import PIL
import torch

from .layout_cache import LayoutCache
from .ops._triton import HAVE_TRITON
from .ops.resample_pass import PRECISION_BITS, resample_pass, resample_pass_reference

# PRECISION_BITS (ops/resample_pass.py) = 32 - 8 - 2: 8 bits of result, 2 of headroom.
# TRITON_PASS: each pass on CUDA as one Triton launch (ops/resample_pass.py) instead of ~7
# torch ops (session 19: the same bytes; with crops.TRITON_CROPS Moondream 2's 640x480 encode
# replay 15.91-16.01 -> 15.67-15.77 ms on the H200, docs/benchmarks.md)
TRITON_PASS = True


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    if -3.0 <= x < 3.0:
        return _sinc(x) * _sinc(x / 3)
    return 0.0


def _bicubic(x: float) -> float:
    """Resample.c's bicubic_filter (a = -0.5), its operations in its order."""
    a = -0.5
    if x < 0.0:
        x = -x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


# filter name -> (function, support), as Resample.c's filter structs
FILTERS = {"lanczos": (_lanczos, 3.0), "bicubic": (_bicubic, 2.0)}


@lru_cache(maxsize=64)
def coefficients(in_size: int, out_size: int, filt: str = "lanczos"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(first input index [out], int32 fixed-point weights [out, ksize]) of one pass,
    as Pillow's precompute_coeffs + normalize_coeffs_8bpc for the box (0, in_size).
    Taps past an output's window have weight 0."""
    fn, filter_support = FILTERS[filt]
    scale = in_size / out_size                      # (double)(in1 - in0) / outSize
    filterscale = max(scale, 1.0)
    support = filter_support * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    inv_filterscale = 1.0 / filterscale
    first = np.zeros(out_size, dtype=np.int64)
    weights = np.zeros((out_size, ksize), dtype=np.int32)
    one = 1 << PRECISION_BITS
    for xx in range(out_size):
        center = (xx + 0.5) * scale                 # in0 = 0
        xmin = max(int(center - support + 0.5), 0)  # int() truncates toward 0, like C
        n = min(int(center + support + 0.5), in_size) - xmin
        k = [fn((x + xmin - center + 0.5) * inv_filterscale) for x in range(n)]
        ww = 0.0
        for w in k:                                 # left to right (not sum(): compensated)
            ww += w
        if ww != 0.0:
            k = [w / ww for w in k]
        first[xx] = xmin
        weights[xx, :n] = [int(-0.5 + w * one) if w < 0 else int(0.5 + w * one) for w in k]
    return first, weights


@lru_cache(maxsize=64)
def _device_tables(in_size: int, out_size: int, device: torch.device, filt: str = "lanczos"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input index [out * ksize] (clamped into the image; clamped taps weigh 0) and
    weights [out, ksize] int32, on `device`."""
    first, weights = coefficients(in_size, out_size, filt)
    index = np.minimum(first[:, None] + np.arange(weights.shape[1]), in_size - 1)
    return (torch.from_numpy(index.reshape(-1)).to(device),
            torch.from_numpy(weights).to(device))


# int32 products per chunk of output positions (256 MB): a 640x480 frame's passes fit in one
# chunk; a 4096x4096 frame's would otherwise take ~1.6 GB at once (small GPUs)
CHUNK_ELEMENTS = 1 << 26


def _pass(x: torch.Tensor, dim: int, out_size: int,
          tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Resample the uint8 [H, W, C] image along dim (0: rows, 1: columns) to out_size;
    tables: this pass's _device_tables (looked up when None). On CUDA (TRITON_PASS): one
    Triton launch (ops/resample_pass.py, the same bytes); else torch ops, in chunks."""
    index, weights = tables if tables is not None else _device_tables(x.shape[dim], out_size,
                                                                      x.device)
    if TRITON_PASS and x.is_cuda and HAVE_TRITON:
        return resample_pass(x, dim, index, weights)
    ksize = weights.shape[1]
    per_out = x.numel() // x.shape[dim] * ksize
    step = max(1, CHUNK_ELEMENTS // per_out)
    if step >= out_size:
        return resample_pass_reference(x, dim, index, weights)
    return torch.cat([resample_pass_reference(x, dim, index[o * ksize:(o + step) * ksize],
                                              weights[o:o + step])
                      for o in range(0, out_size, step)], dim=dim)


def _pillow_version() -> tuple[int, int]:
    major, minor = PIL.__version__.split(".")[:2]
    return int(major), int(minor)


def _vertical_first(h: int, w: int, height: int, width: int,
                    version: tuple[int, int] | None = None) -> bool:
    """Whether Pillow `version` (default: the installed one) resizes [h, w] -> [height,
    width] with the vertical pass first."""
    version = version or _pillow_version()
    if version >= (13, 0):      # Resample.c ImagingResampleInner: horizontal_first
        return h - height > 0 and h - height > (w - width) * 2
    if version >= (12, 2):      # Image.resize: "Resize tall images vertically first"
        return h > w * 100 and height < h
    return False


class ResizePlan:
    """The resize of [in_height, in_width, C] uint8 images to [height, width, C] on one
    device, its passes' coefficient tables already there: calling it launches tensor ops
    only (no host->device copy, no host sync), so it may run inside a CUDA graph capture
    (the graphed encoder's in-graph crops hold one per frame layout). The same ops as
    resize_lanczos / resize_bicubic, which run a plan made on the spot. filt: "lanczos" /
    "bicubic"."""

    def __init__(self, in_height: int, in_width: int, height: int, width: int, device,
                 filt: str = "lanczos"):
        if in_height < 1 or in_width < 1 or height < 1 or width < 1:
            raise ValueError("height and width must be > 0")
        if filt not in FILTERS:
            raise ValueError(f"filter must be one of {tuple(FILTERS)}, not {filt!r}")
        device = torch.device(device)
        self.in_shape, self.out_shape = (in_height, in_width), (height, width)
        order = [(1, width), (0, height)]           # (dim, size): horizontal, vertical
        if _vertical_first(in_height, in_width, height, width):
            order.reverse()
        shape = [in_height, in_width]
        self.passes = []                            # (dim, size, (index, weights))
        for dim, size in order:
            if size != shape[dim]:                  # an unchanged axis is skipped, as PIL does
                self.passes.append((dim, size, _device_tables(shape[dim], size, device,
                                                              filt)))
                shape[dim] = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != torch.uint8 or image.dim() != 3:
            raise ValueError(f"expected a uint8 [H, W, C] tensor, got {image.dtype} "
                             f"{tuple(image.shape)}")
        if tuple(image.shape[:2]) != self.in_shape:
            raise ValueError(f"this plan resizes {self.in_shape} images, got "
                             f"{tuple(image.shape[:2])}")
        x = image
        for dim, size, tables in self.passes:
            x = _pass(x, dim, size, tables)
        if x is image:
            x = x.clone()
        return x


class ResizePlans:
    """A model's ResizePlans by frame size (a camera's frames share one): `for_size(in_h,
    in_w, h, w)` -> the plan of that resize, made on first use, or None when the sizes are
    equal (the frame is used as it is). At most `keep` plans are kept (layout_cache.py)."""

    def __init__(self, device, filt: str, keep: int = 32):
        self.device, self.filt = device, filt
        self.plans = LayoutCache(keep)

    def for_size(self, in_height: int, in_width: int, height: int, width: int
                 ) -> ResizePlan | None:
        if (in_height, in_width) == (height, width):
            return None
        key = (in_height, in_width, height, width)
        return self.plans.get(key, lambda: ResizePlan(*key, self.device, self.filt))


def _resize(image: torch.Tensor, height: int, width: int, filt: str) -> torch.Tensor:
    if image.dtype != torch.uint8 or image.dim() != 3:
        raise ValueError(f"expected a uint8 [H, W, C] tensor, got {image.dtype} "
                         f"{tuple(image.shape)}")
    if height < 1 or width < 1:
        raise ValueError("height and width must be > 0")
    return ResizePlan(image.shape[0], image.shape[1], height, width, image.device, filt)(image)


def resize_lanczos(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, C] -> uint8 [height, width, C], on image's device; the same pixels as
    np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))."""
    return _resize(image, height, width, "lanczos")


def resize_bicubic(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """As resize_lanczos with Image.Resampling.BICUBIC."""
    return _resize(image, height, width, "bicubic")
