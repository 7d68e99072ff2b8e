"""Issue 13's CPU node test: 4 cameras under overload, frames of all cameras stamped the same
tick and published in a fixed order (c0, c1, c2, c3: the order that once starved the last
camera, 170 / 87 / 88 / 2 results in 180 s). Every camera gets results, and a camera whose
tasks are mostly skipped (c3 also asks two tasks with a deadline no engine can meet) says so:
its /diagnostics entry is WARN with the scheduler's reason, and it gets an even share of
frames, not more (the fairness unit is frames served: when a started task counted 1 / (tasks
of its frame), c3 looked a third served and got 1.5-2.3x the others' results). The real node in its own process,
the tiny random model, DDS on loopback; the frames come from this process."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import (Collector, diag_values, moondream_available, spawn_node,  # noqa: E402
                          stop, tiny_model_dir, wait_for, write_config)

pytestmark = pytest.mark.skipif(not moondream_available(),
                                reason="photon_core.moondream not importable")
NODE = "fair_node"
CAMS = ("c0", "c1", "c2", "c3")
FPS = 30.0                     # 4 x 30 frames/s: far more than the CPU serves (overload)


def camera(name: str, extra: dict | None = None) -> dict:
    tasks = {"people": {"skill": "detect", "object": "person", "max_objects": 2,
                        "deadline_ms": 3000.0}}
    tasks.update(extra or {})
    return {"topic": f"/fair/{name}/image", "qos_reliable": True, "qos_depth": 2,
            "tasks": list(tasks), **tasks}


CONFIG = {"cameras": list(CAMS), **{c: camera(c) for c in CAMS[:3]},
          "c3": camera("c3", {
              # 1 ms after arrival: no engine makes it; admission skips these every frame
              "doors": {"skill": "point", "object": "door", "deadline_ms": 1.0},
              "scene": {"skill": "caption", "caption_length": "short", "max_tokens": 4,
                        "deadline_ms": 1.0}})}


def _status(arr, cam):
    for s in arr.status:
        if s.name == f"/{NODE}: camera {cam}":
            return s
    return None


def test_four_cameras_under_overload_all_served_and_the_skipped_one_warns(tmp_path_factory):
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image

    from photon_ros.msg import DetectionArray
    from node_camera import image_msg, make_rgb

    base = tmp_path_factory.getbasetemp()
    cfg = write_config(base / "fair.yaml", CONFIG)
    node = spawn_node("-p", f"model:={tiny_model_dir(base)}", "-p", f"params_file:={cfg}",
                      name=NODE)
    col = Collector("photon_test_fair")
    stop_pub = threading.Event()
    try:
        for c in CAMS:
            col.listen(DetectionArray, f"/{c}/detections")
        col.listen(DiagnosticArray, "/diagnostics")
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=2,
                         reliability=ReliabilityPolicy.RELIABLE)
        pubs = [col.node.create_publisher(Image, f"/fair/{c}/image", qos) for c in CAMS]
        up = wait_for(lambda: all(p.get_subscription_count() for p in pubs), timeout=90)
        assert up, f"node did not subscribe:\n{stop(node)}"
        rgb = make_rgb(48, 64, 0)
        sent = [0]

        def publish():              # one tick: the same stamp for every camera, fixed order
            t_next = time.monotonic()
            while not stop_pub.is_set():
                stamp = 1000.0 + sent[0] / FPS
                for p in pubs:
                    p.publish(image_msg(rgb, stamp, "fair_optical"))
                sent[0] += 1
                t_next += 1 / FPS
                time.sleep(max(0.0, t_next - time.monotonic()))
        th = threading.Thread(target=publish, daemon=True)
        th.start()

        def counts():
            return {c: len(col.msgs(f"/{c}/detections")) for c in CAMS}

        def c3_warns():
            diags = col.msgs("/diagnostics")
            s = _status(diags[-1], "c3") if diags else None
            return s is not None and s.level == DiagnosticStatus.WARN and \
                "not answered" in s.message
        # served long enough to compare the cameras (>= 4 s of frames and 20 results each)
        t0 = time.monotonic()
        ok = wait_for(lambda: time.monotonic() - t0 >= 4.0 and min(counts().values()) >= 20
                      and c3_warns(), timeout=40)
        stop_pub.set()
        th.join(5)
        got = counts()
        diags = col.msgs("/diagnostics")
        last = {c: _status(diags[-1], c) for c in CAMS} if diags else {}
        info = (got, sent[0], {c: (s.level, s.message) for c, s in last.items() if s})
        assert ok, info
        # an even share: the fixed order once gave 170 / 87 / 88 / 2, and counting a started
        # task as 1 / (tasks of its frame) gave c3, whose extra tasks are all skipped,
        # 1.5-2.3x the others' results (min/max 0.43-0.67)
        assert min(got.values()) >= 0.85 * max(got.values()), info
        s3 = last["c3"]
        v3 = {kv.key: kv.value for kv in s3.values}
        assert s3.level == DiagnosticStatus.WARN and "scheduler:" in s3.message, info
        assert "skipped" in s3.message and "cannot meet its deadline" in s3.message, info
        assert float(v3["scheduler.skipped_frac"]) > 0.5, v3
        assert int(v3["skipped"]) > 0 and v3["scheduler.health"] == "warn"
        # the tiny Moondream 2 has crop modes: the message names the cheaper ones
        assert v3["crops"] == "overlap", v3
        assert "crops overlap: a cheaper mode encodes faster (overlap:4 or global)" in \
            s3.message, info
        for c in CAMS[:3]:          # the others: their tasks are answered or superseded
            v = diag_values(diags[-1], f"camera {c}")
            assert float(v["scheduler.skipped_frac"]) < 0.5, (c, v)
            assert "not answered" not in last[c].message, info
    finally:
        stop_pub.set()
        col.close()
        out = stop(node)
    assert "Traceback" not in out, out
