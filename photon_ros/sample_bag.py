"""A small synthetic camera bag: a street-like scene with moving shapes, deterministic.

`make_sample_bag(path)` writes a rosbag2 bag (mcap by default, or sqlite3) with one
sensor_msgs/Image (rgb8) or sensor_msgs/CompressedImage (jpeg) topic per camera, at a
fixed frame rate, with header stamps starting at a fixed epoch: the same arguments always
give the same messages. Used by `photon make-sample-bag`, `photon demo` and the tests, so
nothing large is committed.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from .bag_io import COMPRESSED_IMAGE, IMAGE, BagWriter, encode

T0_NS = 1_700_000_000 * 1_000_000_000      # first header stamp
RECV_DELAY_NS = 3_000_000                  # recorded (log) time = stamp + 3 ms
DEFAULT_TOPIC = "/camera/image_raw"


def render(i: int, fps: float, width: int = 640, height: int = 480, camera: int = 0) -> np.ndarray:
    """Frame i (RGB uint8): sky, road, a car and a person crossing, a bouncing ball."""
    import cv2

    t = i / fps

    def px(v: float) -> int:          # sizes scale with the width, at least one pixel
        return max(1, int(v * s))

    img = np.empty((height, width, 3), np.uint8)
    horizon = int(height * 0.45)
    sky = np.linspace(200, 140, horizon)[:, None]
    img[:horizon] = np.stack([sky * 0.6, sky * 0.8, sky], -1).astype(np.uint8)
    img[horizon:] = (90, 90, 95)
    s = width / 640
    lane_y = int(height * 0.72)
    for x in range(-int(60 * s), width, int(80 * s)):        # moving lane marks
        x0 = x + int((t * 120 * s) % (80 * s))
        cv2.rectangle(img, (x0, lane_y), (x0 + int(40 * s), lane_y + int(6 * s)), (230, 230, 230), -1)
    # car: red box with windows and wheels, left to right (wraps)
    cw, ch = int(150 * s), int(60 * s)
    cx = int((t * 160 * s + camera * 200 * s) % (width + cw)) - cw
    cy = int(height * 0.6)
    cv2.rectangle(img, (cx, cy), (cx + cw, cy + ch), (200, 30, 30), -1)
    cv2.rectangle(img, (cx + int(25 * s), cy - int(30 * s)), (cx + int(115 * s), cy), (170, 25, 25), -1)
    cv2.rectangle(img, (cx + int(35 * s), cy - int(24 * s)), (cx + int(105 * s), cy - int(4 * s)),
                  (150, 200, 230), -1)
    for wx in (cx + int(30 * s), cx + cw - int(30 * s)):
        cv2.circle(img, (wx, cy + ch), px(16), (20, 20, 20), -1)
    # person: walks right to left on the sidewalk
    px_ = int(width - ((t * 70 * s) % (width + 40 * s)))
    py = int(height * 0.42)
    cv2.circle(img, (px_, py), px(12), (230, 190, 160), -1)
    cv2.rectangle(img, (px_ - int(12 * s), py + int(12 * s)), (px_ + int(12 * s), py + int(60 * s)),
                  (40, 120, 40), -1)
    leg = int(10 * s * math.sin(t * 6))
    cv2.line(img, (px_, py + int(60 * s)), (px_ - leg, py + int(95 * s)), (30, 30, 90), px(6))
    cv2.line(img, (px_, py + int(60 * s)), (px_ + leg, py + int(95 * s)), (30, 30, 90), px(6))
    # ball: bounces
    bx = int(width * 0.25 + width * 0.2 * math.sin(t * 1.3))
    by = int(height * 0.85 - abs(math.sin(t * 3.0)) * height * 0.25)
    cv2.circle(img, (bx, by), px(18), (30, 60, 220), -1)
    return img


def image_msg(rgb: np.ndarray, stamp_ns: int, frame_id: str, compressed: bool):
    """A rosbags sensor_msgs Image (rgb8) or CompressedImage (jpeg) dataclass."""
    from .bag_io import typestore

    ts = typestore()
    Header = ts.types["std_msgs/msg/Header"]
    Time = ts.types["builtin_interfaces/msg/Time"]
    header = Header(stamp=Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000),
                    frame_id=frame_id)
    if compressed:
        import cv2

        ok, buf = cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 85])
        if not ok:
            raise RuntimeError("jpeg encoding failed")
        return ts.types[COMPRESSED_IMAGE](header=header, format="rgb8; jpeg compressed bgr8",
                                          data=np.frombuffer(buf.tobytes(), np.uint8))
    h, w = rgb.shape[:2]
    return ts.types[IMAGE](header=header, height=h, width=w, encoding="rgb8", is_bigendian=0,
                           step=w * 3, data=np.ascontiguousarray(rgb).reshape(-1))


def make_sample_bag(path, seconds: float = 3.0, fps: float = 5.0, width: int = 640,
                    height: int = 480, topics: list[str] | tuple[str, ...] = (DEFAULT_TOPIC,),
                    compressed: bool = False, storage: str = "mcap",
                    overwrite: bool = False) -> dict:
    """Write the sample bag; returns a small summary dict."""
    n = max(1, int(round(seconds * fps)))
    mtype = COMPRESSED_IMAGE if compressed else IMAGE
    with BagWriter(path, storage=storage, overwrite=overwrite) as w:
        for i in range(n):
            stamp = T0_NS + int(round(i * 1e9 / fps))
            for c, topic in enumerate(topics):
                rgb = render(i, fps, width, height, camera=c)
                name = topic.strip("/").split("/")[0] or f"camera{c}"
                msg = image_msg(rgb, stamp, f"{name}_optical", compressed)
                w.write_raw(topic, mtype, encode(msg, mtype), stamp + RECV_DELAY_NS)
        count = w.count
    return {"bag": str(path), "storage": storage, "frames": n, "topics": list(topics),
            "type": mtype, "messages": count, "size": f"{width}x{height}", "fps": fps}


# -- command line ----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="bag to write (a folder, rosbag2 layout)")
    p.add_argument("--seconds", type=float, default=3.0, help="bag length in seconds")
    p.add_argument("--fps", type=float, default=5.0, help="frames per second")
    p.add_argument("--width", type=int, default=640, help="image width, pixels")
    p.add_argument("--height", type=int, default=480, help="image height, pixels")
    p.add_argument("--topic", action="append", dest="topics", default=None,
                   help=f"camera topic (repeat for several cameras; default {DEFAULT_TOPIC})")
    p.add_argument("--compressed", action="store_true", help="sensor_msgs/CompressedImage (jpeg)")
    p.add_argument("--storage", choices=["mcap", "sqlite3"], default="mcap",
                   help="rosbag2 storage format")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def main(args) -> int:
    info = make_sample_bag(Path(args.out), seconds=args.seconds, fps=args.fps, width=args.width,
                           height=args.height, topics=args.topics or [DEFAULT_TOPIC],
                           compressed=args.compressed, storage=args.storage,
                           overwrite=args.overwrite)
    print(json.dumps(info))
    return 0
