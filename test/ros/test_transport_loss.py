"""Frames lost before the node (issue 17): a camera publisher sends faster than the node's
image callback takes frames, the subscription's keep-last queue overwrites them, and the node
counts them (`frames_lost_in_transport`, from the publishers' sequence numbers), shows them in
/diagnostics and warns. rmw_fastrtps_cpp does not report these overwrites through
`message_lost` (docs/reliability.md); that event is counted too (unit test below).

In-process: the real node class, its real subscription and executor, a fake scheduler (no
model), a publisher node in its own context; loopback DDS."""
from __future__ import annotations

import os
import random
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(120, 200)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rclpy = pytest.importorskip("rclpy")

from sensor_msgs.msg import Image  # noqa: E402

from photon_ros import perception_node as pn  # noqa: E402
from photon_ros.diagnostics import CAMERA_COUNTERS, camera_status  # noqa: E402
from photon_ros.executor import InlineGroupExecutor  # noqa: E402
from photon_ros.task_config import config_from_params  # noqa: E402
from photon_ros.transport_loss import TransportLoss, loss_problem  # noqa: E402
from fake_live import activate_with_fakes  # noqa: E402
from ros_env import wait_for  # noqa: E402

TOPIC = "/tl/front/image"
PARAMS = {"cameras": ["front"],
          "front": {"topic": TOPIC, "qos_reliable": True, "qos_depth": 1, "tasks": ["people"],
                    "people": {"skill": "detect", "object": "person"}}}


def info(seq, gid=b"A"):
    return {"publication_sequence_number": seq, "publisher_gid": {"data": gid}}


def test_sequence_gaps_reorders_publishers_and_the_rmw_event():
    t = TransportLoss()
    for s in (1, 2, 5, 4, 9):                  # 3, 6, 7, 8 missing (4 came late: not lost)
        t.on_message(info(s), 0.0)
    assert t.totals()["transport.sequence_gaps"] == 4
    for s in (100, 101, 103):                  # a second publisher on the same topic: 102
        t.on_message(info(s, b"B"), 0.0)
    assert t.totals()["transport.sequence_gaps"] == 5
    t.on_message({"publication_sequence_number": None, "publisher_gid": None}, 0.0)
    t.on_message(info(2 ** 64 - 1), 0.0)       # RMW_MESSAGE_INFO_SEQUENCE_NUMBER_UNSUPPORTED
    assert t.totals()["transport.no_sequence_number"] == 2
    t.restart()                                # a new subscription: counted stays counted
    t.on_message(info(50), 1.0)
    assert t.totals()["frames_lost_in_transport"] == 5
    t.on_rmw_lost(7, 1.0)                      # rmw message_lost: the larger total is reported
    tot = t.totals()
    assert (tot["transport.rmw_message_lost"], tot["frames_lost_in_transport"]) == (7, 7)
    w = t.window(5.5, 5.0)                     # the gaps (t=0) are out of the window
    assert w == {"lost": 7, "gaps": 0, "rmw": 7}
    assert t.window(10.0, 5.0)["lost"] == 0
    assert loss_problem({"lost": 2, "gaps": 2, "rmw": 0}, 100, 5.0) is None     # 2 %: ok
    text = loss_problem({"lost": 10, "gaps": 10, "rmw": 3}, 100, 5.0)
    assert "10 frames lost before the node" in text and "3 reported lost by the rmw" in text
    assert "7 more missing from the publisher's sequence" in text


def test_a_frame_delivered_twice_does_not_hide_a_lost_one():
    """The same (publisher, sequence number) taken twice is a duplicate, not a frame: counted
    as seen it would cancel the gap of a frame really lost (5 twice, 6 lost: 1 missing)."""
    t = TransportLoss()
    for s in (1, 2, 3, 4, 5, 5, 7):
        t.on_message(info(s), 0.0)
    tot = t.totals()
    assert (tot["transport.sequence_gaps"], tot["transport.duplicates"]) == (1, 1), tot
    t.on_message(info(6), 0.0)                 # 6 came late after all: nothing missing now
    t.on_message(info(6), 0.0)                 # ... and again: a duplicate
    tot = t.totals()
    assert (tot["transport.sequence_gaps"], tot["transport.duplicates"]) == (0, 2), tot
    for s in range(8, 8 + 3 * 1024):           # a long run: the remembered window is pruned
        t.on_message(info(s), 1.0)
    p = t.pubs[b"A"]
    assert len(p.recent) <= 2 * 1024 + 1 and t.totals()["transport.sequence_gaps"] == 0


def test_message_lost_event_is_counted_and_shown(monkeypatch):
    """The rmw's message_lost event (what best-effort transport losses raise with
    rmw_fastrtps_cpp: docs/reliability.md) reaches the camera's counter and diagnostics."""
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = pn.PerceptionNode("tl_unit", context=ctx)
    try:
        node.config = config_from_params(PARAMS)
        node.cameras.reset(["front"])
        warned = []
        monkeypatch.setattr(node, "warn_throttled", lambda key, text: warned.append(text))
        node.cameras._on_message_lost("front", SimpleNamespace(total_count=12,
                                                               total_count_change=12))
        snap = node.cameras.get("front").stats.snapshot(time.monotonic())
        vals = {kv.key: kv.value for kv in camera_status("n", "front", TOPIC, snap, True).values}
        assert vals["frames_lost_in_transport"] == "12" and vals["transport.rmw_message_lost"] == "12"
        status = camera_status("n", "front", TOPIC, snap, True)
        assert "12 frames lost before the node" in status.message
        assert warned and "12 reported lost by the rmw" in warned[0]
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def test_frames_overwritten_in_the_queue_are_counted_and_warned(monkeypatch):
    ctx, pctx = rclpy.Context(), rclpy.Context()
    rclpy.init(context=ctx)
    rclpy.init(context=pctx)
    node = pn.PerceptionNode("tl_node", context=ctx)
    pub_node = rclpy.create_node("tl_camera", context=pctx)
    ex = InlineGroupExecutor(node.image_group, num_threads=2, context=ctx)
    pex = rclpy.executors.SingleThreadedExecutor(context=pctx)
    threads = []
    try:
        activate_with_fakes(node, PARAMS)
        node.cameras.sync()                            # the real subscription (reliable, depth 1)
        from rclpy.event_handler import QoSSubscriptionEventType as Ev
        sub = node.cameras.get("front").sub
        kinds = {h.event_type for h in sub.event_handlers}
        assert {Ev.RCL_SUBSCRIPTION_MESSAGE_LOST,
                Ev.RCL_SUBSCRIPTION_REQUESTED_INCOMPATIBLE_QOS} <= kinds, kinds
        warned = []
        real_warn = node.warn_throttled
        monkeypatch.setattr(node, "warn_throttled",
                            lambda key, text: (warned.append(text), real_warn(key, text)))
        real_on_image = node.cameras.on_image

        def slow_on_image(camera, msg):                # a node whose image callback is behind
            real_on_image(camera, msg)
            time.sleep(0.02)
        monkeypatch.setattr(node.cameras, "on_image", slow_on_image)

        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        diags = []
        pub_node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        pub = pub_node.create_publisher(Image, TOPIC,
                                        QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE))
        ex.add_node(node)
        pex.add_node(pub_node)
        for e in (ex, pex):
            threads.append(threading.Thread(target=e.spin, daemon=True))
            threads[-1].start()
        assert wait_for(lambda: pub.get_subscription_count() > 0, timeout=20)
        stats = node.cameras.get("front").stats
        msg = Image(height=48, width=64, encoding="rgb8", step=64 * 3)
        msg.data = np.zeros(48 * 64 * 3, np.uint8).tobytes()
        sent = 0

        def send():
            nonlocal sent
            now = time.time()
            msg.header.stamp.sec, msg.header.stamp.nanosec = int(now), int((now % 1) * 1e9)
            pub.publish(msg)
            sent += 1
        # one frame first: the node's baseline of this publisher's sequence
        send()
        assert wait_for(lambda: stats.snapshot(time.monotonic())["counts"].get("frames_in") == 1,
                        timeout=20)
        for _ in range(200):                           # a burst against a <= 50 Hz callback
            send()

        def counts():
            return stats.snapshot(time.monotonic())["counts"]
        # reliable keep-last: the newest frame always arrives, so every frame is either
        # received or counted lost
        assert wait_for(lambda: counts().get("frames_in", 0)
                        + counts()["frames_lost_in_transport"] == sent, timeout=20), counts()
        c = counts()
        assert c["frames_lost_in_transport"] >= 20, c     # depth 1 and a 20 ms callback
        assert c["transport.sequence_gaps"] == c["frames_lost_in_transport"]
        assert any("frames lost before the node" in w for w in warned), warned

        def diag_warn():
            for arr in list(diags):
                for s in arr.status:
                    vals = {kv.key: kv.value for kv in s.values}
                    if (s.name.endswith("camera front") and s.level == s.WARN
                            and "frames lost before the node" in s.message
                            and int(vals["frames_lost_in_transport"]) > 0):
                        return True
            return False
        assert wait_for(diag_warn, timeout=15), [s.message for a in diags for s in a.status]
        assert "frames_lost_in_transport" in CAMERA_COUNTERS
    finally:
        for e in (ex, pex):
            e.shutdown()
        for t in threads:
            t.join(5)
        pub_node.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=pctx)
        rclpy.try_shutdown(context=ctx)
