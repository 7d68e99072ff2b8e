"""use_sim_time: result latency is measured on the node clock (source stamp to publish), so
under simulated time (bag replay) it is simulated latency, and a clock that jumps back (bag
loop) resets the camera instead of stopping results."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import (Collector, moondream_available, spawn_camera, spawn_node,  # noqa: E402
                          stamp_of, stop, tiny_model_dir, wait_for, write_config)

pytestmark = pytest.mark.skipif(not moondream_available(),
                                reason="photon_core.moondream not importable")


def test_latency_uses_the_simulated_clock(tmp_path_factory, tmp_path):
    from photon_ros.msg import DetectionArray

    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    cfg = write_config(tmp_path / "sim.yaml", {
        "default_deadline_ms": 5000.0, "cameras": ["sim"],
        "sim": {"topic": "/simt/image", "tasks": ["people"],
                "people": {"skill": "detect", "object": "person", "max_objects": 1}}})
    node = spawn_node("-p", f"model:={model}", "-p", f"params_file:={cfg}",
                      "-p", "use_sim_time:=true", name="sim_node")
    col = Collector("photon_test_simtime")
    try:
        col.listen(DetectionArray, "/sim/detections")
        # stamps 2000.0, 2000.2, ... and /clock 0.25 s ahead of each frame; looping back
        # every 8 frames like a replayed bag. The camera loops until the node has answered
        # enough (a loaded machine drops or supersedes some frames: best-effort QoS, latest
        # frame wins), at most 5 minutes of frames; the checks below wait for their condition.
        cam = spawn_camera("--topic", "/simt/image", "--fps", "5", "--stamp0", "2000.0",
                           "--clock-offset", "0.25", "--pattern", "loop", "--loop-len", "8",
                           "--count", "1500", "--wait", "120")

        def again_after_a_jump(dets):      # the frame at 2000.2 answered in 2 loops or more
            return sum(1 for d in dets if abs(stamp_of(d) - 2000.2) < 1e-6) >= 2
        try:
            ok = wait_for(lambda: len(col.msgs("/sim/detections")) >= 14
                          and again_after_a_jump(col.msgs("/sim/detections")), timeout=240)
        finally:
            out = stop(cam)
        dets = col.msgs("/sim/detections")
        assert ok, ([stamp_of(d) for d in dets], out)
        lat = sorted(d.timing.latency_ms for d in dets)
        # simulated: 250 ms (+ at most one more frame period while the result is made);
        # the wall clock would say ~56 years
        assert 200 < lat[len(lat) // 2] < 500, (lat, out)
        assert again_after_a_jump(dets)
    finally:
        col.close()
        out = stop(node)
    assert "Traceback" not in out, out
