"""Experiment (not a test): which lost frames does the rmw report through `message_lost`, and
which only show as gaps in the publishers' sequence numbers (rclpy MessageInfo)?

    python test/ros/dds_loss_experiment.py [--reliable 0|1] [--sub-depth 5] [--pub-depth 5]
        [--sleep 0.1] [--fps 30] [--n 150] [--width 640 --height 480] [--profile XML]

A subscriber process (callback sleeping --sleep s) and a publisher (this process, --n frames of
--width x --height rgb8 at --fps, frame_id = its index) on loopback DDS in a random domain;
--profile sets FASTDDS_DEFAULT_PROFILES_FILE for both (config/fastdds_large_images.xml: large
frames through shared memory). Prints, from the subscriber: frames received, frames missing
between the first and last received (frame_id gaps), gaps in publication_sequence_number, and
the message_lost total. Results of 2026-11-30 in docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"


def qos(a, depth):
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    return QoSProfile(depth=depth, history=HistoryPolicy.KEEP_LAST,
                      reliability=ReliabilityPolicy.RELIABLE if a.reliable
                      else ReliabilityPolicy.BEST_EFFORT)


def subscriber(a) -> None:
    import rclpy
    from rclpy.event_handler import SubscriptionEventCallbacks
    from sensor_msgs.msg import Image
    rclpy.init()
    node = rclpy.create_node("loss_exp_sub")
    st = {"ids": [], "seqs": [], "lost": 0, "incompatible": 0}

    def on_lost(info):
        st["lost"] = info.total_count

    def on_incompatible(info):
        st["incompatible"] += 1

    def cb(msg, info):
        st["ids"].append(int(msg.header.frame_id))
        st["seqs"].append(info["publication_sequence_number"])
        time.sleep(a.sleep)
    node.create_subscription(Image, "/loss_exp/image", cb, qos(a, a.sub_depth),
                             event_callbacks=SubscriptionEventCallbacks(
                                 message_lost=on_lost, incompatible_qos=on_incompatible))
    print("ready", flush=True)
    end = time.monotonic() + a.n / a.fps + 8
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.1)

    def gaps(xs):
        return sum(y - x - 1 for x, y in zip(xs, xs[1:]) if y > x + 1)
    ids = st["ids"]
    print(json.dumps({"received": len(ids), "first_id": ids[0] if ids else None,
                      "last_id": ids[-1] if ids else None, "id_gaps": gaps(ids),
                      "sequence_gaps": gaps(st["seqs"]), "rmw_message_lost": st["lost"],
                      "incompatible_qos": st["incompatible"]}), flush=True)
    rclpy.shutdown()


def publisher(a) -> None:
    import rclpy
    from sensor_msgs.msg import Image
    rclpy.init()
    node = rclpy.create_node("loss_exp_pub")
    pub = node.create_publisher(Image, "/loss_exp/image", qos(a, a.pub_depth))
    end = time.monotonic() + 20
    while pub.get_subscription_count() == 0 and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(0.5)
    msg = Image(height=a.height, width=a.width, encoding="rgb8", step=a.width * 3)
    msg.data = bytes(a.width * a.height * 3)
    t = time.monotonic()
    for i in range(a.n):
        msg.header.frame_id = str(i)
        pub.publish(msg)
        t += 1.0 / a.fps
        time.sleep(max(0.0, t - time.monotonic()))
    time.sleep(2)
    rclpy.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="both", choices=["both", "sub"])
    ap.add_argument("--reliable", type=int, default=1)
    ap.add_argument("--sub-depth", type=int, default=5)
    ap.add_argument("--pub-depth", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--fps", type=float, default=30.0)
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    if a.profile:
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = os.path.abspath(a.profile)
    if a.role == "sub":
        subscriber(a)
        return 0
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(110, 200)))
    sub = subprocess.Popen([sys.executable, __file__, "--role", "sub", *sys.argv[1:]],
                           stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert sub.stdout.readline().strip() == "ready"
    publisher(a)
    out = sub.communicate(timeout=60)[0].strip().splitlines()
    print(json.dumps({"sent": a.n, **json.loads(out[-1])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
