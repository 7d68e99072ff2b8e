"""Fault injection against the real node over DDS (loopback), no node changes needed:
an engine error on one request (others unaffected), a camera publisher killed and
restarted, deactivate/activate under load, the model folder vanishing between deactivate
and activate, SIGINT/SIGTERM mid-stream (clean exit), and a replay interrupted mid-bag
(its output bag closed and readable). One node serves the module; the SIGTERM and replay
tests start their own processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import (REPO, Collector, diag_values, moondream_available,  # noqa: E402
                          spawn_camera, spawn_node, stop, tiny_model_dir, unit_node, wait_for,
                          write_config)
from ros_env import child_env  # noqa: E402

pytestmark = pytest.mark.skipif(not moondream_available(),
                                reason="photon_core.moondream not importable")
NODE = "flt_node"
TOPIC = "/flt/front/image"
CONFIG = {"default_deadline_ms": 5000.0, "cameras": ["front"],
          "front": {"topic": TOPIC, "tasks": ["people"],
                    "people": {"skill": "detect", "object": "person", "max_objects": 2}}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from diagnostic_msgs.msg import DiagnosticArray
    from lifecycle_msgs.srv import ChangeState, GetState

    from photon_ros.msg import DetectionArray
    from photon_ros.srv import Query

    base = tmp_path_factory.getbasetemp()
    model = tmp_path_factory.mktemp("flt") / "model"       # its own copy: one test moves it
    shutil.copytree(tiny_model_dir(base), model)
    cfg = write_config(base / "faults.yaml", CONFIG)
    node = spawn_node("-p", f"model:={model}", "-p", f"params_file:={cfg}", name=NODE)
    col = Collector("photon_test_faults")
    col.listen(DetectionArray, "/front/detections")
    col.listen(DiagnosticArray, "/diagnostics")
    query = col.node.create_client(Query, f"/{NODE}/query")
    if not query.wait_for_service(timeout_sec=90):
        col.close()
        pytest.fail(f"node did not come up:\n{stop(node)}")
    e = {"col": col, "node": node, "model": model, "query": query,
         "change": col.node.create_client(ChangeState, f"/{NODE}/change_state"),
         "get_state": col.node.create_client(GetState, f"/{NODE}/get_state")}
    yield e
    col.close()
    node.send_signal(signal.SIGINT)                 # SIGINT mid-stream: a clean exit
    try:
        rc = node.wait(30)
    except subprocess.TimeoutExpired:
        node.kill()
        rc = "killed after 30 s"
    out = node.communicate()[0] or ""
    assert rc == 0 and "Traceback" not in out, f"rc {rc}\n{out[-4000:]}"


def _camera(*extra):
    return spawn_camera("--topic", TOPIC, "--fps", "10", "--stamp0", "now", *extra)


def _more(col, n: int, timeout: float = 40.0) -> bool:
    before = len(col.msgs("/front/detections"))
    return wait_for(lambda: len(col.msgs("/front/detections")) >= before + n, timeout=timeout)


def _transition(env, tid: int) -> bool:
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    return env["col"].call(env["change"], ChangeState.Request(transition=Transition(id=tid)),
                           timeout=90).success


def _state(env) -> int:
    from lifecycle_msgs.srv import GetState
    return env["col"].call(env["get_state"], GetState.Request()).current_state.id


def _node_diag(col, pred, timeout: float = 10.0) -> dict:
    box: dict = {}

    def check():
        for arr in reversed(col.msgs("/diagnostics")):
            v = diag_values(arr, f"{NODE}: node")
            if v is not None:
                box.clear()
                box.update(v)
                return pred(v)
        return False
    wait_for(check, timeout=timeout)
    return box


def test_engine_error_on_one_request_leaves_the_others_alone(env):
    """A query the engine refuses (its prompt does not fit the tiny model's context: the
    engine raises inside the scheduler) fails alone: periodic results keep flowing and the
    next request succeeds."""
    from photon_ros.srv import Query

    col = env["col"]
    cam = _camera()
    try:
        assert _more(col, 3)
        bad = col.call(env["query"], Query.Request(camera="front", skill="query",
                                                   question="猫" * 300, max_tokens=4), timeout=60)
        assert not bad.success and "fit" in bad.message, bad.message
        assert _more(col, 3), "periodic results stopped after the engine error"
        good = col.call(env["query"], Query.Request(camera="front", skill="caption",
                                                    caption_length="short", max_tokens=4),
                        timeout=60)
        assert good.success, good.message
        for bad_req in (Query.Request(camera="front", skill="detect", object="x" * 100_000),
                        Query.Request(camera="front", skill="detect", object="cup",
                                      max_objects=4_000_000_000),
                        Query.Request(camera="front", skill="query", question="q",
                                      max_tokens=4_000_000_000),
                        Query.Request(camera="nope", skill="caption"),
                        Query.Request(camera="front", skill="dance")):
            r = col.call(env["query"], bad_req, timeout=30)
            assert not r.success and r.message and len(r.message) < 1000, r.message
        assert _more(col, 2)
    finally:
        stop(cam)
    assert env["node"].poll() is None


def test_camera_publisher_dies_and_returns(env):
    col = env["col"]
    cam = _camera()
    assert _more(col, 3)
    cam.kill()                                        # SIGKILL: no goodbye
    cam.wait(10)
    time.sleep(2.0)
    n = len(col.msgs("/front/detections"))
    cam = _camera()                                   # a new process, new publisher
    try:
        assert wait_for(lambda: len(col.msgs("/front/detections")) >= n + 3, timeout=40), \
            "no results after the camera came back"
    finally:
        stop(cam)
    assert env["node"].poll() is None


def test_deactivate_activate_under_load(env):
    from lifecycle_msgs.msg import State, Transition

    col = env["col"]
    cam = _camera("--fps", "20")
    try:
        assert _more(col, 3)
        for _ in range(2):
            assert _transition(env, Transition.TRANSITION_DEACTIVATE)
            assert _state(env) == State.PRIMARY_STATE_INACTIVE
            assert _transition(env, Transition.TRANSITION_ACTIVATE)
            assert _state(env) == State.PRIMARY_STATE_ACTIVE
            assert _more(col, 3), "no results after re-activation"
    finally:
        stop(cam)
    assert env["node"].poll() is None


def test_model_folder_disappears_between_deactivate_and_activate(env):
    from lifecycle_msgs.msg import State, Transition

    col = env["col"]
    model = env["model"]
    assert _transition(env, Transition.TRANSITION_DEACTIVATE)
    gone = model.with_name("model_moved_away")
    model.rename(gone)
    try:
        assert not _transition(env, Transition.TRANSITION_ACTIVATE)   # refused, clearly
        assert _state(env) == State.PRIMARY_STATE_INACTIVE
        d = _node_diag(col, lambda v: v.get("activate_failures") == "1")
        assert d.get("activate_failures") == "1" and d["model_loaded"] == "false", d
    finally:
        gone.rename(model)
    assert _transition(env, Transition.TRANSITION_ACTIVATE)            # and back
    cam = _camera()
    try:
        assert _more(col, 3)
    finally:
        stop(cam)


def test_sigterm_mid_stream_is_a_clean_exit(tmp_path_factory, tmp_path):
    from photon_ros.msg import DetectionArray

    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    cfg = write_config(tmp_path / "term.yaml", {**CONFIG, "front": {**CONFIG["front"],
                                                                    "topic": "/term/image"}})
    node = spawn_node("-p", f"model:={model}", "-p", f"params_file:={cfg}", name="term_node")
    col = Collector("photon_test_term")
    cam = None
    try:
        col.listen(DetectionArray, "/front/detections")
        cam = spawn_camera("--topic", "/term/image", "--fps", "15", "--stamp0", "now")
        assert wait_for(lambda: len(col.msgs("/front/detections")) >= 3, timeout=90)
        t0 = time.monotonic()
        node.send_signal(signal.SIGTERM)
        rc = node.wait(30)
        took = time.monotonic() - t0
    finally:
        if cam is not None:
            stop(cam)
        col.close()
        out = stop(node)
    assert rc == 0 and "Traceback" not in out, f"rc {rc}\n{out[-3000:]}"
    assert took < 15, took


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_replay_interrupted_mid_bag_leaves_a_readable_bag(tmp_path_factory, tmp_path, sig):
    from photon_ros.bag_io import BagReader
    from photon_ros.sample_bag import make_sample_bag

    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    bag = tmp_path / "in"
    # 1200 frames: the tiny model replays ~60-100 frames/s, so the replay is still running
    # when the signal comes (300 frames ended within the wait on an idle machine)
    make_sample_bag(bag, seconds=120.0, fps=10.0, width=320, height=240)
    cfg = write_config(tmp_path / "r.yaml", {"cameras": ["front"], "front": {
        "topic": "/camera/image_raw", "tasks": ["people"],
        "people": {"skill": "detect", "object": "person", "max_objects": 2}}})
    out = tmp_path / "out"
    # the child starts with SIGINT at its default, as from a terminal: a test run started in
    # the background of a script (SIGINT ignored, inherited; Python then keeps ignoring it)
    # must not turn the SIGINT case into a replay that cannot be interrupted
    p = subprocess.Popen([sys.executable, "-m", "photon_core.cli", "replay", str(bag), "--params",
                          str(cfg), "--out", str(out), "--model", str(model), "--no-progress"],
                         cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # mid-stream: the output bag exists and the replay has been running for a while
        assert wait_for(lambda: any(out.glob("*.mcap")), timeout=90)
        time.sleep(1.0)
        assert p.poll() is None, "the replay ended before it could be interrupted"
        p.send_signal(sig)
        text = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in text, text[-3000:]
    assert p.returncode != 0 and "interrupted" in text, (p.returncode, text[-2000:])
    summary = json.loads((out / "replay_summary.json").read_text())
    assert summary["error"] == "interrupted" and 0 < summary["results"] < 1200, summary
    with BagReader(out) as r:                               # closed: metadata + footer
        assert not r.salvaged
        n = sum(1 for m in r.messages() if m.topic == "/front/detections")
    assert n == summary["results"]


def test_deadline_cancelled_periodic_tasks_are_counted():
    """A periodic detect/point task cut at its deadline (on_miss=cancel: status 'deadline',
    nothing published) is counted as `deadline_cancelled`, so a camera's counters add up:
    tasks_submitted = results_published + superseded + skipped + cancelled +
    deadline_cancelled + error.engine (bench_soak --on-miss cancel showed 'unaccounted').
    A query cut at its deadline is still published (partial answer)."""
    from std_msgs.msg import Header

    from photon_core.scheduler.request import Outcome, Status
    from photon_core.task import Task, TaskResult
    from photon_ros.diagnostics import CAMERA_COUNTERS, camera_status

    with unit_node("flt_unit", CONFIG) as node:
        published = []

        def publish(st, outcome, header, key, w, h):      # no publishers in this unit test
            published.append(outcome)
            st.stats.published(key, 1.0, time.monotonic())
        node.cameras.publish = publish
        det = Task("detect", object="person", max_objects=2)
        ask = Task("query", question="What is here?")
        cut = TaskResult(task=det, output={"objects": []}, finish_reason="deadline")
        cases = [(Status.DEADLINE, cut), (Status.DEADLINE, None), (Status.DONE, cut),
                 (Status.SUPERSEDED, None), (Status.SKIPPED, None), (Status.CANCELLED, None),
                 (Status.ERROR, None),
                 (Status.DEADLINE, TaskResult(task=ask, output={"answer": "a"},
                                              finish_reason="deadline"))]
        for i, (status, res) in enumerate(cases):
            key = (0, float(i))
            o = Outcome(request_id=i, stream="front", stamp=key, task_name="people",
                        kind="periodic", status=status, result=res,
                        missed_deadline=status is Status.DEADLINE)
            node.cameras.states["front"].stats.count("tasks_submitted")
            node.cameras.on_outcome("front", Header(), key, 64, 48, o)
        snap = node.cameras.states["front"].stats.snapshot(time.monotonic())
        c = snap["counts"]
        assert c.get("deadline_cancelled") == 2, c
        assert len(published) == 2                       # the DONE one and the partial answer
        accounted = sum(c.get(k, 0) for k in ("results_published", "superseded", "skipped",
                                              "cancelled", "error.engine", "deadline_cancelled"))
        assert accounted == c["tasks_submitted"] == len(cases), c
        assert "deadline_cancelled" in CAMERA_COUNTERS
        vals = {kv.key: kv.value for kv in
                camera_status("n", "front", TOPIC, snap, True).values}
        assert vals["deadline_cancelled"] == "2"


def test_result_after_the_context_ended_is_counted_not_a_traceback():
    """SIGTERM: rclpy's signal handler ends the context while the scheduler thread may still
    finish a run; its publish then fails ("publisher's context is invalid", seen in
    test_sigterm_mid_stream_is_a_clean_exit). That result is counted as
    `unpublished_at_shutdown`; while the context is up, a publish failure still raises (the
    scheduler logs it)."""
    import rclpy
    from std_msgs.msg import Header

    from photon_core.scheduler.request import Outcome, Status
    from photon_core.task import Task, TaskResult
    from photon_ros.diagnostics import CAMERA_COUNTERS

    with unit_node("flt_shutdown", CONFIG) as node:
        def publish(st, outcome, header, key, w, h):
            raise RuntimeError("Failed to publish: publisher's context is invalid")
        node.cameras.publish = publish
        res = TaskResult(task=Task("detect", object="person", max_objects=2),
                         output={"objects": []}, finish_reason="eos")
        o = Outcome(request_id=1, stream="front", stamp=(0, 1.0), task_name="people",
                    kind="periodic", status=Status.DONE, result=res)
        with pytest.raises(RuntimeError):
            node.cameras.on_outcome("front", Header(), (0, 1.0), 64, 48, o)
        rclpy.try_shutdown(context=node.context)
        node.cameras.on_outcome("front", Header(), (0, 2.0), 64, 48, o)
        c = node.cameras.states["front"].stats.snapshot(time.monotonic())["counts"]
        assert c.get("unpublished_at_shutdown") == 1, c
        assert "unpublished_at_shutdown" in CAMERA_COUNTERS


def test_engine_fallbacks_in_the_node_status():
    """The node's status carries the engine's fallbacks (FastEngine.fallbacks) as
    engine.* values; encode layouts / prompt buckets without a graph and frames encoded
    without one turn it to WARN with the reason; a megakernel fallback (the normal case for
    a family without a megakernel lowering) is reported, not warned about."""
    from diagnostic_msgs.msg import DiagnosticStatus

    from photon_ros.diagnostics import node_status

    class Engine:
        def __init__(self, **fb):
            self.fb = {"encoder_capture_errors": 0, "prefill_capture_errors": 0,
                       "encoder_eager_encodes": 0, "megakernel_fallback": "", **fb}

        def fallbacks(self):
            return self.fb

    ok = node_status("n", "active", "m", True, {}, None,
                     Engine(megakernel_fallback="no lowering for this family"))
    vals = {kv.key: kv.value for kv in ok.values}
    assert ok.level == DiagnosticStatus.OK and ok.message == "active"
    assert vals["engine.megakernel_fallback"] == "no lowering for this family"
    warn = node_status("n", "active", "m", True, {}, None,
                       Engine(encoder_eager_encodes=3, encoder_capture_errors=1))
    assert warn.level == DiagnosticStatus.WARN
    assert "3 frames encoded without a graph" in warn.message
    assert "1 encode layouts without a CUDA graph" in warn.message
    assert node_status("n", "active", "m", True, {}).level == DiagnosticStatus.OK
