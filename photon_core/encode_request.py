"""Per-frame encode settings that travel with the image: how many crops the vision encoder
sees.

    from photon_core.encode_request import EncodeRequest
    enc = engine.encode_image(EncodeRequest(frame, crops="global"))   # or:
    enc = engine.encode_image(frame, crops="global")
    encs = engine.encode_batch([EncodeRequest(f1, crops="global"), f2])

Crop modes:
  "overlap" (default): the family's full tiling (Moondream 2: a global 378x378 view plus up
    to 12 overlapping local crops; a 640x480 frame: 1 + 2x4 = 9 crops);
  "overlap:N" (N >= 1): the same tiling rule with a budget of at most N local crops (the
    model's own `max_crops` setting lowered for this frame; a budget above the model's is
    the model's): Moondream 2, 640x480 frame, "overlap:4" = 1 + 2x2 = 5 crops - a middle
    ground between detail and speed;
  "global": the global view only (Moondream 2: one crop; its features stand in for the local
    grid as for an image that fits one crop, i.e. the tiling (1, 1)). ~1/9 of the vision
    work of a 640x480 frame; less detail for small objects.

The scheduler passes a frame's image to `encode_image` / `encode_batch` untouched, so a
camera that wants speed more than detail wraps its frames in an `EncodeRequest` (the node's
per-camera setting); `shape` / `size` are the wrapped image's, so the scheduler's image-size
keyed cost model and crop estimate see through it. An engine-wide default is
`EngineOptions.crops`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the crop modes' forms; "overlap:N" stands for any budget N (Capabilities.crop_modes lists
# the forms a family serves)
CROP_MODES = ("overlap", "global", "overlap:N")
MAX_CROP_BUDGET = 64


def parse_crops(crops) -> tuple[str, int | None]:
    """A crop mode -> (its form in CROP_MODES, its budget N or None); ValueError when it is
    none of them."""
    if crops in ("overlap", "global"):
        return crops, None
    if isinstance(crops, str) and crops.startswith("overlap:"):
        n = crops[len("overlap:"):]
        if n.isascii() and n.isdigit() and 1 <= int(n) <= MAX_CROP_BUDGET and n == str(int(n)):
            return "overlap:N", int(n)
    raise ValueError(f"unknown crops mode {crops!r}; expected overlap, global or overlap:N "
                     f"(at most N local crops, 1 <= N <= {MAX_CROP_BUDGET})")


def check_crops(crops: str) -> str:
    parse_crops(crops)
    return crops


def crop_budget(crops: str, max_crops: int) -> int:
    """The local crops' budget of an overlap mode: the model's max_crops, lowered by an
    "overlap:N" budget."""
    n = parse_crops(crops)[1]
    return max_crops if n is None else min(n, max_crops)


@dataclass(frozen=True)
class EncodeRequest:
    """An image plus its encode settings (see the module doc)."""
    image: Any
    crops: str = "overlap"

    def __post_init__(self):
        check_crops(self.crops)
        if isinstance(self.image, EncodeRequest):
            raise ValueError("EncodeRequest of an EncodeRequest")

    @property
    def shape(self):
        """The wrapped image's shape (numpy / tensor) or None (PIL: see size)."""
        return getattr(self.image, "shape", None)

    @property
    def size(self):
        """The wrapped image's PIL size (width, height), else the array's element count."""
        return getattr(self.image, "size", None)


def unwrap(image: Any, crops: str | None, default: str = "overlap") -> tuple[Any, str]:
    """(image, crops mode): an explicit `crops` wins over an EncodeRequest's, which wins over
    the engine default."""
    if isinstance(image, EncodeRequest):
        return image.image, check_crops(crops if crops is not None else image.crops)
    return image, check_crops(crops if crops is not None else default)


__all__ = ["CROP_MODES", "EncodeRequest", "check_crops", "crop_budget", "parse_crops", "unwrap"]
