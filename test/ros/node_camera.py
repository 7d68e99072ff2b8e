"""A fake camera for the perception node tests, run as a separate process.

    python node_camera.py --topic /t/image [--type image|compressed] [--fps 10] [--count 0]
        [--pattern good|bad|loop] [--stamp0 100.0] [--width 64 --height 48] [--reliable]

Stamps: stamp0 + i / fps for the i-th good frame (pattern loop: i modulo --loop-len, so the
stamps jump back). frame_id: --frame-id. Pattern bad interleaves, for sensor_msgs/Image: an
unknown encoding, data shorter than step*height, a 0x0 image and a 16k x 16k header (no
pixels behind it: refused on size before any data is read), then a good frame; for
CompressedImage: a corrupt JPEG, then a good one. Prints "published N" lines.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # before rclpy.init(): loopback only

import numpy as np  # noqa: E402
import rclpy  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, HistoryPolicy  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402


def make_rgb(h: int, w: int, i: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 4 + i) % 256, (y * 4) % 256, ((x + y) * 2 + 3 * i) % 256], axis=2)
    return img.astype(np.uint8)


def image_msg(rgb: np.ndarray, stamp: float, frame_id: str, encoding: str = "rgb8",
              pad: int = 0) -> Image:
    h, w = rgb.shape[:2]
    if encoding == "bgr8":
        rgb = rgb[:, :, ::-1]
    row = np.ascontiguousarray(rgb).reshape(h, w * 3)
    if pad:
        row = np.concatenate([row, np.zeros((h, pad), np.uint8)], axis=1)
    msg = Image(height=h, width=w, encoding=encoding, step=w * 3 + pad)
    msg.data = row.tobytes()
    set_stamp(msg, stamp, frame_id)
    return msg


def set_stamp(msg, stamp: float, frame_id: str) -> None:
    sec = int(stamp)
    msg.header.stamp.sec = sec
    msg.header.stamp.nanosec = int(round((stamp - sec) * 1e9)) % 1_000_000_000
    msg.header.frame_id = frame_id


def jpeg_msg(rgb: np.ndarray, stamp: float, frame_id: str) -> CompressedImage:
    import cv2
    ok, buf = cv2.imencode(".jpg", rgb[:, :, ::-1])
    assert ok
    msg = CompressedImage(format="jpeg")
    msg.data = buf.tobytes()
    set_stamp(msg, stamp, frame_id)
    return msg


def bad_images(stamp: float, frame_id: str, w: int, h: int) -> list:
    unknown = image_msg(make_rgb(h, w, 0), stamp, frame_id)
    unknown.encoding = "yuv422_weird"
    short = image_msg(make_rgb(h, w, 0), stamp, frame_id)
    short.data = bytes(short.data)[: len(short.data) // 2]
    empty = Image(height=0, width=0, encoding="rgb8", step=0)
    set_stamp(empty, stamp, frame_id)
    huge = Image(height=16384, width=16384, encoding="rgb8", step=16384 * 3)
    huge.data = bytes(64)
    set_stamp(huge, stamp, frame_id)
    return [unknown, short, empty, huge]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topic", required=True)
    ap.add_argument("--type", default="image", choices=["image", "compressed"])
    ap.add_argument("--fps", type=float, default=10.0)
    ap.add_argument("--count", type=int, default=0, help="good frames to send; 0 = forever")
    ap.add_argument("--pattern", default="good", choices=["good", "bad", "loop"])
    ap.add_argument("--loop-len", type=int, default=10)
    ap.add_argument("--stamp0", default="100.0", help="first stamp (s), or 'now'")
    ap.add_argument("--frame-id", default="cam_optical")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--height", type=int, default=48)
    ap.add_argument("--encoding", default="rgb8")
    ap.add_argument("--reliable", action="store_true")
    ap.add_argument("--clock-offset", type=float, default=None,
                    help="also publish /clock = frame stamp + this (simulated time)")
    ap.add_argument("--wait", type=float, default=20.0, help="seconds to wait for a subscriber")
    args = ap.parse_args()

    rclpy.init()
    node = rclpy.create_node("photon_test_camera")
    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=5,
                     reliability=ReliabilityPolicy.RELIABLE if args.reliable
                     else ReliabilityPolicy.BEST_EFFORT)
    msg_type = CompressedImage if args.type == "compressed" else Image
    pub = node.create_publisher(msg_type, args.topic, qos)
    clock_pub = None
    if args.clock_offset is not None:
        from rosgraph_msgs.msg import Clock
        clock_pub = node.create_publisher(Clock, "/clock", 10)
    end = time.monotonic() + args.wait
    while pub.get_subscription_count() == 0 and time.monotonic() < end:
        time.sleep(0.05)
    print(f"subscribers {pub.get_subscription_count()}", flush=True)
    period = 1.0 / args.fps
    stamp0 = time.time() if args.stamp0 == "now" else float(args.stamp0)
    i = 0
    t_next = time.monotonic()
    try:
        while rclpy.ok() and (args.count == 0 or i < args.count):
            k = i % args.loop_len if args.pattern == "loop" else i
            stamp = stamp0 + k * period
            rgb = make_rgb(args.height, args.width, i)
            if clock_pub is not None:
                t = stamp + args.clock_offset
                c = Clock()
                c.clock.sec, c.clock.nanosec = int(t), int(round((t - int(t)) * 1e9)) % 1_000_000_000
                clock_pub.publish(c)
            if args.pattern == "bad":
                if args.type == "compressed":
                    bad = jpeg_msg(rgb, stamp, args.frame_id)
                    bad.data = bytes(bad.data)[:20] + bytes(range(256)) * 4
                    pub.publish(bad)
                else:
                    for b in bad_images(stamp, args.frame_id, args.width, args.height):
                        pub.publish(b)
                        time.sleep(0.002)
                time.sleep(0.01)
            if args.type == "compressed":
                pub.publish(jpeg_msg(rgb, stamp, args.frame_id))
            else:
                pub.publish(image_msg(rgb, stamp, args.frame_id, args.encoding))
            i += 1
            if i % 10 == 0:
                print(f"published {i}", flush=True)
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
    except KeyboardInterrupt:
        pass
    print(f"done {i}", flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
