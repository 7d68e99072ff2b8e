"""sensor_msgs/Image and CompressedImage -> numpy HxWx3 uint8 RGB.

We convert ourselves instead of using cv_bridge: the PyPI `cv-bridge` (1.13) is broken with
numpy 2 (`tostring`) and OpenCV 5 (channel count), and on a normal ROS install it would be one
more C++ dependency for a few lines of numpy.

`image_to_rgb` returns zero-copy numpy views of `msg.data` where it can (rgb8 with or without
row padding; bgr8/bgra8/rgba8 as strided views); the engine makes its own contiguous copy when
it needs one. Views share memory with the message: do not modify them in place.

Everything that cannot be converted raises `ImageConversionError` (a ValueError) whose
`reason` is one of the REASON_* strings below, used as the diagnostics counter name.
"""
from __future__ import annotations

import numpy as np

REASON_UNKNOWN_ENCODING = "unknown_encoding"
REASON_SHORT_DATA = "short_data"
REASON_BAD_STEP = "bad_step"
REASON_EMPTY = "empty_image"
REASON_TOO_LARGE = "too_large"
REASON_DECODE_FAILED = "decode_failed"
REASONS = (REASON_UNKNOWN_ENCODING, REASON_SHORT_DATA, REASON_BAD_STEP, REASON_EMPTY,
           REASON_TOO_LARGE, REASON_DECODE_FAILED)

# 16k x 16k (268 M pixels) is refused by default; 8K (33 M) still passes. The engine then
# shrinks anything above its own limit (4096 px long side) cheaply.
DEFAULT_MAX_PIXELS = 40_000_000

# encoding -> (channels, channel order to pick for RGB or None for mono)
_ENCODINGS = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, None),
    "8uc1": (1, None),
    "8uc3": (3, (2, 1, 0)),     # OpenCV convention: 8UC3 is BGR
}
SUPPORTED_ENCODINGS = tuple(_ENCODINGS)


class ImageConversionError(ValueError):
    """An image message that cannot be turned into RGB; `reason` names the class of problem."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_size(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    if width <= 0 or height <= 0:
        raise ImageConversionError(REASON_EMPTY, f"image is empty ({width}x{height})")
    if max_pixels and width * height > max_pixels:
        raise ImageConversionError(
            REASON_TOO_LARGE, f"image is {width}x{height} = {width * height / 1e6:.0f} M pixels; "
            f"the limit (max_pixels) is {max_pixels / 1e6:.0f} M: refused")


def image_to_rgb(msg, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """sensor_msgs/Image -> HxWx3 uint8 RGB (a view of msg.data where possible).

    Supports rgb8, bgr8, rgba8, bgra8, mono8 (and 8UC1/8UC3), honoring `step` (row padding).
    """
    w, h, step = int(msg.width), int(msg.height), int(msg.step)
    check_size(w, h, max_pixels)
    enc = (msg.encoding or "").strip().lower()
    if enc not in _ENCODINGS:
        raise ImageConversionError(
            REASON_UNKNOWN_ENCODING, f"unsupported encoding {msg.encoding!r}; supported: "
            f"{', '.join(('rgb8', 'bgr8', 'rgba8', 'bgra8', 'mono8'))}")
    ch, order = _ENCODINGS[enc]
    row = w * ch
    if step == 0:
        step = row
    if step < row:
        raise ImageConversionError(
            REASON_BAD_STEP, f"step {step} is shorter than a {w}-pixel {enc} row ({row} bytes)")
    # The last row does not need its padding: some drivers send data of step*(h-1)+row bytes.
    need = step * (h - 1) + row
    data = msg.data
    n = len(data)
    if n < need:
        raise ImageConversionError(
            REASON_SHORT_DATA, f"data is {n} bytes; a {w}x{h} {enc} image with step {step} "
            f"needs {step * h}")
    buf = np.frombuffer(data, dtype=np.uint8)
    if n >= step * h:
        rows = buf[:step * h].reshape(h, step)
    else:
        rows = np.lib.stride_tricks.as_strided(buf, shape=(h, step), strides=(step, 1))
        rows = rows[:, :row]
    pix = rows[:, :row].reshape(h, w, ch)
    if order is None:
        return np.repeat(pix, 3, axis=2)            # mono -> gray RGB (a copy)
    if order == (0, 1, 2):
        return pix[:, :, :3]                         # rgb8: a view; rgba8: a strided view
    return pix[:, :, 2::-1]                          # bgr8/bgra8 -> rgb as a view


def compressed_to_rgb(msg, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """sensor_msgs/CompressedImage (jpeg, png, ...) -> HxWx3 uint8 RGB via cv2.imdecode.

    The header of the compressed stream is read first (cv2 decodes only after the size is
    known to be within max_pixels, for JPEG and PNG)."""
    import cv2

    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size == 0:
        raise ImageConversionError(REASON_EMPTY, "compressed image has no data")
    size = _peek_size(data[:64 * 1024].tobytes())
    if size is not None:
        check_size(size[0], size[1], max_pixels)
    try:
        img = cv2.imdecode(data, cv2.IMREAD_COLOR)
    except cv2.error as e:
        raise ImageConversionError(REASON_DECODE_FAILED,
                                   f"cannot decode {msg.format or 'compressed'} image: {e}") from None
    if img is None or img.size == 0:
        raise ImageConversionError(
            REASON_DECODE_FAILED, f"cannot decode {msg.format or 'compressed'} image "
            f"({data.size} bytes): corrupt or unsupported")
    if img.ndim == 2:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
        return img
    check_size(img.shape[1], img.shape[0], max_pixels)
    return img[:, :, 2::-1] if img.shape[2] >= 3 else np.repeat(img[:, :, :1], 3, axis=2)


def _peek_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG or JPEG header, else None (cheap; no decoding)."""
    if head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) >= 24:
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(head):
            if head[i] != 0xFF:
                return None
            marker = head[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            seg = int.from_bytes(head[i + 2:i + 4], "big")
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                h = int.from_bytes(head[i + 5:i + 7], "big")
                w = int.from_bytes(head[i + 7:i + 9], "big")
                return w, h
            i += 2 + seg
    return None


def rgb_to_image_msg(rgb: np.ndarray, header=None, encoding: str = "rgb8"):
    """numpy HxWx3 uint8 RGB -> sensor_msgs/Image (rgb8 or bgr8); used for annotated output."""
    from sensor_msgs.msg import Image

    if encoding == "bgr8":
        rgb = rgb[:, :, ::-1]
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    msg = Image()
    if header is not None:
        msg.header = header
    msg.height, msg.width = int(rgb.shape[0]), int(rgb.shape[1])
    msg.encoding, msg.is_bigendian, msg.step = encoding, 0, int(rgb.shape[1] * 3)
    msg.data = rgb.tobytes()
    return msg
