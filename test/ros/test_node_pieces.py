"""Unit tests of the node's pieces added with the split: the vision_msgs convention, where the
configuration comes from (params_file, the node's own --params-file, the example file), frame
sequencing shared with realtime replay, and the once-only note when vision_msgs is missing.
In-process, no DDS traffic."""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rclpy = pytest.importorskip("rclpy")

from builtin_interfaces.msg import Time  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from photon_core.task import Task, TaskResult  # noqa: E402
from photon_ros import cameras as cameras_mod  # noqa: E402
from photon_ros.live_pipeline import JUMP, NEW, STALE, FrameSequencer  # noqa: E402
from photon_ros.node_parameters import params_files_in_args  # noqa: E402
from photon_ros.perception_node import PerceptionNode  # noqa: E402
from photon_ros.result_messages import (build_result, points_to_vision_msgs,  # noqa: E402
                                        to_vision_msgs, vision_msgs_missing)
from photon_ros.task_config import config_from_params  # noqa: E402

from node_helpers import write_config  # noqa: E402

HEADER = Header(stamp=Time(sec=1_700_000_123, nanosec=456_789), frame_id="cam_optical")
needs_vision = pytest.mark.skipif(vision_msgs_missing() is not None,
                                  reason=f"vision_msgs not importable: {vision_msgs_missing()}")


@pytest.fixture
def ctx():
    c = rclpy.Context()
    rclpy.init(context=c)
    yield c
    rclpy.try_shutdown(context=c)


# -- vision_msgs -------------------------------------------------------------------------------
@needs_vision
def test_detection2d_convention():
    res = TaskResult(Task("detect", object="person"),
                     {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6},
                                  {"x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 1.0}]})
    v = to_vision_msgs(build_result(res, HEADER, "front", "people", "md2", 640, 480))
    assert v.header == HEADER and len(v.detections) == 2
    d = v.detections[0]
    assert d.header == HEADER and d.id == "people"
    assert (d.bbox.center.position.x, d.bbox.center.position.y) == pytest.approx((192.0, 192.0))
    assert (d.bbox.size_x, d.bbox.size_y) == pytest.approx((256.0, 192.0))
    assert d.bbox.center.theta == 0.0
    assert len(d.results) == 1 and d.results[0].hypothesis.class_id == "person"
    assert d.results[0].hypothesis.score == 1.0          # Moondream gives no confidence


@needs_vision
def test_points_as_zero_size_detections():
    res = TaskResult(Task("point", object="hand"), {"points": [{"x": 0.25, "y": 0.5}]})
    v = points_to_vision_msgs(build_result(res, HEADER, "front", "hands", "md2", 100, 40))
    (d,) = v.detections
    assert (d.bbox.center.position.x, d.bbox.center.position.y) == (25.0, 20.0)
    assert (d.bbox.size_x, d.bbox.size_y) == (0.0, 0.0)
    assert d.results[0].hypothesis.class_id == "hand" and d.header == HEADER


def test_without_vision_msgs_the_node_says_once(ctx, monkeypatch):
    """Where vision_msgs cannot be imported: photon_ros topics only, one warning."""
    monkeypatch.setattr(cameras_mod, "vision_msgs_missing", lambda: "No module named 'vision_msgs'")
    node = PerceptionNode("vm_node", context=ctx)
    warnings = []
    monkeypatch.setattr(node, "get_logger", lambda: type("L", (), {
        "warning": staticmethod(warnings.append), "info": staticmethod(lambda *_: None)})())
    try:
        cfg = config_from_params({"cameras": ["a", "b"],
                                  "a": {"topic": "/vm/a", "tasks": []},
                                  "b": {"topic": "/vm/b", "tasks": []}})
        assert cfg.publish_vision_msgs                    # on by default
        pubs = [node.cameras._publishers(c, cfg) for c in ("a", "b")]
        assert all(set(p) == {"detections", "points", "answer"} for p in pubs)
        said = [w for w in warnings if "vision_msgs" in w]
        assert len(said) == 1 and "No module named 'vision_msgs'" in said[0]
        assert "publish_vision_msgs:=false" in said[0]
    finally:
        node.destroy_node()


# -- where the configuration comes from -------------------------------------------------------------
def test_params_files_in_args():
    argv = ["prog", "--ros-args", "-p", "a:=1", "--params-file", "/x/a.yaml", "-r", "__node:=n",
            "--params-file", "/tmp/launch_params_1", "--", "--params-file", "not/ros.yaml"]
    assert params_files_in_args(argv) == ["/x/a.yaml", "/tmp/launch_params_1"]
    assert params_files_in_args(["prog"]) == [] and params_files_in_args(None) == []


MINE = {"model": "/models/x", "cameras": ["left"],
        "left": {"topic": "/mine/left", "tasks": ["cups"], "cups": {"skill": "detect",
                                                                   "object": "cup"}}}


def _overrides(d: dict, prefix: str = "") -> list[Parameter]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _overrides(v, f"{prefix}{k}.")
        else:
            out.append(Parameter(f"{prefix}{k}", value=v))
    return out


def test_own_params_file_gives_the_cameras(ctx, tmp_path):
    """As `--params-file mine.yaml` does: the parameters arrive as overrides. Before, the
    installed example file was read too and its camera reported as unknown."""
    path = str(tmp_path / "mine.yaml")
    node = PerceptionNode("pf_node", context=ctx, params_files=[path],
                          parameter_overrides=_overrides(MINE))
    try:
        cfg = node.params.read()
        assert cfg.camera_names == ["left"] and cfg.camera("left").topic == "/mine/left"
        assert not cfg.extra
        assert node.params.source == f"the node's parameters (--params-file {path})"
        assert not node.has_parameter("front.topic")      # nothing of the example file
    finally:
        node.destroy_node()


def test_params_file_parameter_is_read_and_named(ctx, tmp_path):
    path = write_config(tmp_path / "p.yaml", MINE)
    node = PerceptionNode("pp_node", context=ctx, parameter_overrides=[
        Parameter("params_file", value=str(path)), Parameter("left.topic", value="/override")])
    try:
        cfg = node.params.read()
        assert cfg.camera_names == ["left"] and cfg.camera("left").topic == "/override"
        assert node.params.source == str(path)
    finally:
        node.destroy_node()


def test_no_cameras_given_falls_back_to_the_example_and_says_so(ctx):
    node = PerceptionNode("ex_node", context=ctx, parameter_overrides=[
        Parameter("model", value="/m")])
    try:
        cfg = node.params.read()
        assert cfg.camera_names == ["front"]              # config/perception.yaml
        assert "perception.yaml (the installed example" in node.params.source
    finally:
        node.destroy_node()


# -- frame sequencing (the node and realtime replay) ----------------------------------------------
def test_frame_sequencer_epochs_and_stale_frames():
    resets = []
    seq = FrameSequencer(on_jump=resets.append)
    t = [seq.next("c", s) for s in (10.0, 10.1, 10.1, 10.05, 10.2, 3.0, 3.1)]
    assert [x.event for x in t] == [NEW, NEW, STALE, STALE, NEW, JUMP, NEW]
    assert [x.index for x in t if x.event != STALE] == [0, 1, 2, 0, 1]
    assert t[4].key == (0, 10.2) and t[5].key == (1, 3.0) and t[6].key == (1, 3.1)
    assert math.isclose(t[5].jumped_s, 7.2) and resets == ["c"]
    assert seq.next("other", 1.0).index == 0           # per camera


# -- diagnostics: the scheduler's view of each camera ------------------------------------------
def test_camera_diagnostics_warn_with_the_scheduler_reason(ctx):
    """A camera whose tasks the scheduler skips (it cannot meet the deadline) reports WARN with
    the scheduler's reason and its values (result_rate_hz, skipped_frac, since_last_result_s);
    a camera the scheduler serves stays OK with the same values; one it has not seen has none."""
    import time
    from types import SimpleNamespace

    from diagnostic_msgs.msg import DiagnosticStatus

    from photon_core.scheduler import CostModel, Policy, Scheduler, VirtualClock
    from photon_core.scheduler.simulator import SimEngine, SimImage
    from photon_ros.diagnostics import publish_diagnostics

    clock = VirtualClock()
    cost = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                     prefill_per_token_ms=0.0, decode_step_ms={1: 2.0}, ema=0.0)
    sched = Scheduler(SimEngine(clock, cost, jitter=0.0), cost, clock=clock,
                      policy=Policy(probe_after_s=0.0, task_probe_after_s=0.0))
    det = Task("detect", object="person")
    for k in range(40):                       # 4 s at 10 fps
        sched.submit_frame("front", k, SimImage((300, 300), (("person", 3),)),
                           [("people", det, 0.005)])          # 5 ms: never makes it
        sched.submit_frame("rear", k, SimImage((300, 300), (("person", 3),)),
                           [("people", det, 0.5)])
        sched.run_until_idle()
        clock.advance(0.1)
    cfg = config_from_params({"cameras": ["front", "rear", "side"],
                              **{c: {"topic": f"/d/{c}", "tasks": ["people"],
                                     "people": {"skill": "detect", "object": "person"}}
                                 for c in ("front", "rear", "side")}})
    node = PerceptionNode("diag_health", context=ctx)
    sent = []
    try:
        node.config = cfg
        node.cameras.reset(cfg.camera_names)
        for st in node.cameras.all():
            st.stats.frame_in(time.monotonic())
        node.live = SimpleNamespace(scheduler=sched, model=None)
        node.active = True
        node.diag_pub = SimpleNamespace(publish=sent.append)
        publish_diagnostics(node)
    finally:
        node.active, node.live = False, None
        node.destroy_node()
    status = {s.name.rsplit(" ", 1)[-1]: s for s in sent[0].status}
    health = sched.stream_health()
    front, rear, side = status["front"], status["rear"], status["side"]
    vals = {kv.key: kv.value for kv in front.values}
    assert health["front"].level == "warn"
    assert front.level == DiagnosticStatus.WARN
    assert health["front"].reason in front.message and "scheduler" in front.message
    assert float(vals["scheduler.skipped_frac"]) == pytest.approx(1.0)
    assert float(vals["scheduler.result_rate_hz"]) == 0.0
    assert vals["scheduler.since_last_result_s"] == "none"
    rvals = {kv.key: kv.value for kv in rear.values}
    assert rear.level == DiagnosticStatus.OK, rear.message
    assert float(rvals["scheduler.result_rate_hz"]) > 5.0
    assert float(rvals["scheduler.skipped_frac"]) == 0.0
    assert float(rvals["scheduler.since_last_result_s"]) < 1.0
    assert side.level == DiagnosticStatus.OK
    assert not [kv for kv in side.values if kv.key.startswith("scheduler.")]
