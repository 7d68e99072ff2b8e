"""`photon play IN_BAG`: publish a bag's camera topics live at recorded timing, plus /clock.

For end-to-end tests of the running node where `ros2 bag play` is missing (PyPI ROS has no
rosbag2_py). Messages are published as the recorded CDR bytes (no re-serialization), with
reliable keep-last QoS (compatible with the node's best-effort sensor subscriptions).
/clock carries the recorded (log) time, like `ros2 bag play --clock`: run the node with
`use_sim_time:=true` to have latency measured against bag time.

Sets ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST unless it is already set (workplace rule:
loopback discovery only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

from .bag_io import CAMERA_TYPES, CLOCK, BagError, BagReader
from .cli import parse_pairs
from .deferred_interrupt import DeferredInterrupt
from .progress import progress_bar

DEFAULT_CLOCK_HZ = 50.0


def select_topics(topics: dict[str, str], wanted: list[str] | None, all_topics: bool) -> dict[str, str]:
    """{topic: type} to publish: the named topics, or every camera topic (or all)."""
    if wanted:
        missing = [t for t in wanted if t not in topics]
        if missing:
            raise BagError(f"topics not in the bag: {', '.join(missing)} "
                           f"(bag has: {', '.join(sorted(topics)) or 'nothing'})")
        return {t: topics[t] for t in wanted}
    sel = {t: ty for t, ty in topics.items() if all_topics or ty in CAMERA_TYPES}
    sel.pop("/clock", None)
    if not sel:
        raise BagError("no camera topics (sensor_msgs/Image or CompressedImage) in the bag; "
                       f"it has: {', '.join(f'{t} [{ty}]' for t, ty in topics.items()) or 'nothing'}")
    return sel


def play(bag, topics: list[str] | None = None, rate: float = 1.0, clock_hz: float = DEFAULT_CLOCK_HZ,
         wait_subscribers: float = 0.0, loop: int = 1, all_topics: bool = False,
         remap: dict[str, str] | None = None, progress: bool = False, settle_s: float = 0.5,
         context=None, log: Callable[[str], None] | None = None) -> dict:
    """Publish the bag; returns counts. Creates its own rclpy context unless given one."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from .bag_io import rclpy_type

    if rate <= 0:
        raise ValueError("rate must be > 0")
    log = log or (lambda s: print(s, file=sys.stderr))
    remap = remap or {}
    with BagReader(bag) as r:
        sel = select_topics(r.topics, topics, all_topics)
        total = r.topic_count(sel)
    for ty in sel.values():
        try:
            rclpy_type(ty)
        except (ImportError, AttributeError) as e:
            raise BagError(f"message type {ty!r} is not available to rclpy: {e}") from e

    own = context is None
    if own:
        context = rclpy.Context()
        rclpy.init(context=context)
    stats = {"published": 0, "per_topic": {}, "clock": 0, "loops": 0, "error": None}
    node = rclpy.create_node("photon_play", context=context)
    try:
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        pubs = {t: node.create_publisher(rclpy_type(ty), remap.get(t, t), qos) for t, ty in sel.items()}
        clock_pub = node.create_publisher(rclpy_type(CLOCK), "/clock", qos) if clock_hz > 0 else None
        if wait_subscribers > 0:
            end = time.monotonic() + wait_subscribers
            while time.monotonic() < end and not all(p.get_subscription_count() > 0 for p in pubs.values()):
                time.sleep(0.05)
            missing = [remap.get(t, t) for t, p in pubs.items() if p.get_subscription_count() == 0]
            if missing:
                log(f"photon play: no subscriber on {', '.join(missing)} after "
                    f"{wait_subscribers:.0f} s; publishing anyway")
            else:
                time.sleep(settle_s)   # let the subscriber's side of discovery finish too
        Clock = rclpy_type(CLOCK)
        Time = rclpy_type("builtin_interfaces/msg/Time")

        def pub_clock(t_ns: int) -> None:
            if clock_pub is not None:
                clock_pub.publish(Clock(clock=Time(sec=t_ns // 1_000_000_000,
                                                   nanosec=t_ns % 1_000_000_000)))
                stats["clock"] += 1

        bar = progress_bar(total * loop, progress, "play", "msg")
        # a signal is taken between messages (see deferred_interrupt)
        with DeferredInterrupt() as interrupt:
            try:
                for _ in range(loop):
                    with BagReader(bag) as r:
                        wall0 = bag0 = None
                        next_clock = 0.0
                        try:
                            for m in r.messages(sel):
                                if wall0 is None:
                                    wall0, bag0 = time.monotonic(), m.log_time_ns
                                due = wall0 + (m.log_time_ns - bag0) / 1e9 / rate
                                # wait, publishing /clock on its own rate meanwhile
                                while True:
                                    interrupt.check()   # a signal stops here, between messages
                                    now = time.monotonic()
                                    if clock_pub is not None and now >= next_clock:
                                        pub_clock(bag0 + int((now - wall0) * rate * 1e9))
                                        next_clock = now + 1.0 / clock_hz
                                    if now >= due:
                                        break
                                    time.sleep(min(due - now, (next_clock - now) if clock_pub else 1.0, 0.05))
                                pub_clock(m.log_time_ns)
                                pubs[m.topic].publish(m.raw)
                                stats["published"] += 1
                                stats["per_topic"][m.topic] = stats["per_topic"].get(m.topic, 0) + 1
                                if bar is not None:
                                    bar.update(1)
                        except BagError as e:       # truncated bag: what was read went out
                            stats["error"] = str(e)
                            log(f"photon play: {e}")
                            break
                    stats["loops"] += 1
            finally:
                if bar is not None:
                    bar.close()
        time.sleep(0.2)   # let the last reliable messages go out before the node closes
    except KeyboardInterrupt:
        stats["error"] = "interrupted"
    finally:
        node.destroy_node()
        if own:
            rclpy.shutdown(context=context)
    return stats


# -- command line ----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bag", help="rosbag2 bag (folder, .mcap or .db3)")
    p.add_argument("--topic", action="append", dest="topics", default=None,
                   help="topic to publish (repeat; default: every camera topic)")
    p.add_argument("--all-topics", action="store_true", help="publish every topic rclpy knows")
    p.add_argument("--rate", type=float, default=1.0, help="playback speed factor")
    p.add_argument("--clock-hz", type=float, default=DEFAULT_CLOCK_HZ,
                   help="/clock publish rate (0 = no /clock)")
    p.add_argument("--wait-subscribers", type=float, default=10.0, metavar="SEC",
                   help="wait up to SEC for a subscriber on every topic before starting")
    p.add_argument("--loop", type=int, default=1, help="play the bag this many times")
    p.add_argument("--remap", action="append", default=[], metavar="FROM:=TO")
    p.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    remap = parse_pairs(args.remap, ":=", "--remap", "FROM:=TO")
    stats = play(args.bag, topics=args.topics, rate=args.rate, clock_hz=args.clock_hz,
                 wait_subscribers=args.wait_subscribers, loop=args.loop,
                 all_topics=args.all_topics, remap=remap,
                 progress=not args.no_progress and sys.stderr.isatty())
    print(json.dumps(stats))
    return 1 if stats["error"] else 0
