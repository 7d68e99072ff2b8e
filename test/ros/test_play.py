"""`photon play` -> the perception node -> results, over real DDS (loopback): the node runs in
its own process, `play` publishes the sample bag at recorded timing with /clock, and this
test collects what the node publishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")
pytest.importorskip("torch")

from node_helpers import (REPO, Collector, diag_values, spawn_node, stamp_of, stop,  # noqa: E402
                          tiny_model_dir, wait_for, write_config)

from photon_ros.bag_io import BagError, deserialize, read_all  # noqa: E402
from photon_ros.play import play, select_topics  # noqa: E402
from photon_ros.sample_bag import make_sample_bag  # noqa: E402
from ros_env import child_env  # noqa: E402

TOPIC = "/play_test/image_raw"
CONFIG = {
    "default_deadline_ms": 5000.0,
    "cameras": ["front"],
    "front": {"topic": TOPIC, "qos_reliable": True, "qos_depth": 10,
              "tasks": ["people", "scene"],
              "people": {"skill": "detect", "object": "person", "max_objects": 2},
              "scene": {"skill": "caption", "caption_length": "short", "every_n": 3,
                        "max_tokens": 6, "on_miss": "finish"}},
}


def test_select_topics():
    topics = {"/a": "sensor_msgs/msg/Image", "/b": "sensor_msgs/msg/CompressedImage",
              "/clock": "rosgraph_msgs/msg/Clock", "/x": "acme_msgs/msg/Thing"}
    assert select_topics(topics, None, False) == {"/a": topics["/a"], "/b": topics["/b"]}
    assert "/x" in select_topics(topics, None, True) and "/clock" not in select_topics(topics, None, True)
    with pytest.raises(BagError, match="topics not in the bag: /nope"):
        select_topics(topics, ["/nope"], False)
    with pytest.raises(BagError, match=r"no camera topics .* /x \[acme_msgs/msg/Thing\]"):
        select_topics({"/x": "acme_msgs/msg/Thing"}, None, False)


def test_unknown_type_is_a_clear_error(tmp_path):
    from rosbags.rosbag2 import StoragePlugin, Writer

    with Writer(tmp_path / "u", version=9, storage_plugin=StoragePlugin.MCAP) as w:
        c = w.add_connection("/x", "acme_msgs/msg/Thing", msgdef="uint8 a\n",
                             rihs01="RIHS01_" + "0" * 64)
        w.write(c, 1, b"\x00\x01\x00\x00\x07")
    with pytest.raises(BagError, match="'acme_msgs/msg/Thing' is not available to rclpy"):
        play(tmp_path / "u", topics=["/x"])


def test_play_to_node_over_dds(tmp_path_factory):
    from diagnostic_msgs.msg import DiagnosticArray
    from rosgraph_msgs.msg import Clock

    from photon_ros.msg import Answer, DetectionArray

    base = tmp_path_factory.getbasetemp()
    bag = make_sample_bag(base / "play_bag", seconds=2.0, fps=5, width=160, height=120,
                          topics=[TOPIC])["bag"]
    src = {stamp_of(deserialize(m.raw, m.msgtype)) for m in read_all(bag)}
    cfg = write_config(base / "play_node.yaml", CONFIG)
    node = spawn_node("-p", f"model:={tiny_model_dir(base)}", "-p", f"params_file:={cfg}",
                      "-p", "use_sim_time:=true")
    col = Collector("photon_play_checker")
    try:
        col.listen(DetectionArray, "/front/detections")
        col.listen(Answer, "/front/answer")
        col.listen(Clock, "/clock")
        col.listen(DiagnosticArray, "/diagnostics")
        # the results are counted against the node's own count below: the collector must have
        # matched the node's result publishers before the first frame is played
        assert wait_for(lambda: col.matched("/front/detections", "/front/answer"),
                        timeout=90), "the node's result publishers were not discovered"
        # play waits for the node's camera subscription (it appears once the model is loaded)
        stats = {}
        th = threading.Thread(target=lambda: stats.update(play(bag, wait_subscribers=90)))
        th.start()
        th.join(150)
        assert not th.is_alive(), "play did not finish"
        assert stats["published"] == 10 and stats["error"] is None and stats["clock"] >= 10
        # Every played frame reaches the node, and every task it submitted is accounted for:
        # published, or dropped by the deadline scheduler (a slow, loaded machine makes the
        # newest frame supersede queued ones - that is the policy, not a loss).
        def accounted():
            diags = col.msgs("/diagnostics")
            d = diag_values(diags[-1], "camera front") if diags else None
            if not d or d["frames_in"] != "10":
                return False
            # each task ends exactly one way (a late result is published *and* counted in
            # deadline_misses, so deadline_misses is not one of the ways)
            ended = sum(int(d.get(k, "0")) for k in (
                "results_published", "superseded", "skipped", "deadline_cancelled",
                "cancelled", "error.engine"))
            return ended == int(d["tasks_submitted"]) and int(d["results_published"]) >= 3
        # generous waits on conditions: a loaded 2-core machine may take long for the node to
        # work through the played frames and for DDS to deliver its results
        assert wait_for(accounted, timeout=120), diag_values(col.msgs("/diagnostics")[-1],
                                                              "camera front")
        d = diag_values(col.msgs("/diagnostics")[-1], "camera front")
        assert wait_for(lambda: len(col.msgs("/front/detections")) +
                        len(col.msgs("/front/answer")) >= int(d["results_published"]), timeout=60)
        dets = col.msgs("/front/detections")
        assert len(dets) >= 2, f"only {len(dets)} detection results"
        assert {stamp_of(d) for d in dets} <= src           # results carry the bag's headers
        assert all(d.camera == "front" and d.task.name == "people" and d.image_width == 160
                   for d in dets)
        assert all(d.header.frame_id == "play_test_optical" for d in dets)
        # use_sim_time: latency is measured on the bag clock that play publishes
        assert all(0 <= d.timing.latency_ms < 5000 for d in dets), [d.timing.latency_ms for d in dets]
        answers = col.msgs("/front/answer")
        assert answers and {stamp_of(a) for a in answers} <= src
        clock = col.msgs("/clock")
        assert clock and abs(clock[-1].clock.sec - 1_700_000_001) <= 1
    finally:
        col.close()
        out = stop(node)
    assert "Traceback" not in out, out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_play_interrupted_mid_bag_stops_between_messages(tmp_path, sig):
    """`photon play` under a signal (Ctrl-C, or a launch / container stop): the message being
    published finishes, the player stops, and it says so (error "interrupted", the messages it
    published, exit status 1) - no traceback out of rclpy's publish call."""
    bag = tmp_path / "in"
    make_sample_bag(bag, seconds=60.0, fps=10.0, width=64, height=48)
    p = subprocess.Popen([sys.executable, "-m", "photon_core.cli", "play", str(bag),
                          "--wait-subscribers", "0", "--no-progress"], cwd=REPO,
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(4.0)            # rclpy up, a few seconds of the 60 s bag published
        assert p.poll() is None, "the player ended before it could be interrupted"
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])
    assert p.returncode == 1 and stats["error"] == "interrupted", (p.returncode, stats, err)
    assert 0 < stats["published"] < 600, stats
