"""The perception node over real DDS (loopback): the node, the cameras and this test are
separate processes. One node (4 cameras) serves the whole module; each test drives its
own camera processes and checks what comes out."""
from __future__ import annotations

import math
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import (Collector, diag_values, moondream_available,  # noqa: E402
                          settle_new_client, spawn_camera, spawn_node, stamp_of, stop,
                          tiny_model_dir, wait_for, write_config)

pytestmark = pytest.mark.skipif(not moondream_available(),
                                reason="photon_core.moondream not importable")

W, H = 64, 48
CONFIG = {
    "default_deadline_ms": 5000.0,
    "debug_ignore_eos": True,         # text runs to max_tokens: long enough to cancel
    "debug_step_delay_ms": 4.0,
    "annotate": True,                 # <camera>/annotated, drawn only while subscribed
    "cameras": ["front", "back", "comp", "rel"],
    "front": {"topic": "/pt/front/image", "tasks": ["people", "cups", "scene"],
              "people": {"skill": "detect", "object": "person", "max_objects": 3},
              "cups": {"skill": "point", "object": "cup", "every_n": 2, "max_objects": 2},
              "scene": {"skill": "caption", "caption_length": "short", "every_n": 4,
                        "max_tokens": 6, "on_miss": "finish"}},
    "back": {"topic": "/pt/back/image", "tasks": ["bags"],
             "bags": {"skill": "detect", "object": "bag", "max_objects": 2}},
    "comp": {"topic": "/pt/comp/image", "type": "compressed", "tasks": ["people"],
             "people": {"skill": "detect", "object": "person", "max_objects": 2}},
    "rel": {"topic": "/pt/rel/image", "qos_reliable": True, "qos_depth": 5, "tasks": ["people"],
            "people": {"skill": "detect", "object": "person", "max_objects": 1}},
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from diagnostic_msgs.msg import DiagnosticArray

    from photon_ros.msg import Answer, DetectionArray, PointArray

    base = tmp_path_factory.getbasetemp()
    model = tiny_model_dir(base)
    cfg = write_config(base / "node_dds.yaml", CONFIG)
    node = spawn_node("-p", f"model:={model}", "-p", f"params_file:={cfg}")
    col = Collector()
    for cam in CONFIG["cameras"]:
        col.listen(DetectionArray, f"/{cam}/detections")
        col.listen(PointArray, f"/{cam}/points")
        col.listen(Answer, f"/{cam}/answer")
    col.listen(DiagnosticArray, "/diagnostics")
    from photon_ros.srv import Query
    client = col.node.create_client(Query, "/perception_node/query")
    ok = client.wait_for_service(timeout_sec=60)
    if not ok:
        out = stop(node)
        col.close()
        pytest.fail(f"node did not come up:\n{out}")
    yield {"col": col, "node": node, "model": model, "query": client}
    col.close()
    out = stop(node)
    assert "Traceback" not in out, out


def last_diag(col, suffix: str, pred=None, timeout: float = 10.0) -> dict:
    """The newest diagnostics values of `suffix` (e.g. "camera front") satisfying pred."""
    found: dict = {}

    def check():
        for arr in reversed(col.msgs("/diagnostics")):
            v = diag_values(arr, suffix)
            if v is not None:
                found.clear()
                found.update(v)
                return pred is None or pred(v)
        return False
    wait_for(check, timeout=timeout)
    return found


def run_camera(col, key: str, n: int, *args: str, timeout: float = 40.0):
    """Run a camera process until `key` has n more messages; returns (msgs, camera output)."""
    before = len(col.msgs(key))
    cam = spawn_camera(*args)
    try:
        ok = wait_for(lambda: len(col.msgs(key)) >= before + n, timeout=timeout)
    finally:
        out = stop(cam)
    assert ok, f"only {len(col.msgs(key)) - before} new messages on {key}; camera said:\n{out}"
    return col.msgs(key)[before:], out


def test_results_carry_the_source_headers(env):
    col = env["col"]
    for k in ("/front/detections", "/front/points", "/front/answer"):
        col.clear(k)
    dets, _ = run_camera(col, "/front/detections", 8, "--topic", "/pt/front/image", "--fps", "5",
                         "--stamp0", "500.0", "--frame-id", "front_optical")
    wait_for(lambda: col.msgs("/front/answer"), timeout=5)
    sent = [500.0 + i * 0.2 for i in range(200)]
    for m in dets:
        assert m.header.frame_id == "front_optical"
        assert min(abs(stamp_of(m) - s) for s in sent) < 1e-6, stamp_of(m)
        assert (m.camera, m.task.name, m.task.skill, m.task.target) == ("front", "people", "detect",
                                                                        "person")
        assert m.model_id == str(env["model"]) and (m.image_width, m.image_height) == (W, H)
        assert len(m.detections) == 3                       # ignore_eos: runs to max_objects
        for d in m.detections:
            assert math.isnan(d.score) and d.label == "person"
            assert 0 <= d.box.x_min <= d.box.x_max <= 1 and 0 <= d.box.y_min <= d.box.y_max <= 1
            assert d.bbox.center_x == pytest.approx((d.box.x_min + d.box.x_max) / 2 * W)
            assert d.bbox.size_y == pytest.approx((d.box.y_max - d.box.y_min) * H)
        assert m.timing.engine_ms > 0 and m.timing.queue_ms >= 0
    stamps = [stamp_of(m) for m in dets]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    pts = col.msgs("/front/points")
    assert 1 <= len(pts) <= len(dets) // 2 + 1            # every 2nd frame
    assert all(p.task.name == "cups" and len(p.points) == 2 and p.header.frame_id == "front_optical"
               for p in pts)
    assert all(0 <= p.points[0].x <= W and p.points[0].x == pytest.approx(p.points[0].x_norm * W)
               for p in pts)
    ans = col.msgs("/front/answer")
    assert ans and all(a.task.name == "scene" and a.task.target == "short" for a in ans)
    assert all(a.tokens == 6 and a.finish_reason == "length" for a in ans)
    assert {stamp_of(a) for a in ans} <= set(stamps) | {stamp_of(p) for p in pts} | set(sent)


def test_two_cameras_into_one_node(env):
    col = env["col"]
    col.clear("/front/detections")
    col.clear("/back/detections")
    back = spawn_camera("--topic", "/pt/back/image", "--fps", "5", "--stamp0", "now",
                        "--frame-id", "back_optical")
    try:
        dets, _ = run_camera(col, "/front/detections", 6, "--topic", "/pt/front/image", "--fps",
                             "5", "--stamp0", "now", "--frame-id", "front_optical")
        assert wait_for(lambda: len(col.msgs("/back/detections")) >= 6, timeout=20)
        # (a diagnostics message from before the back camera's second result says
        # processed_fps 0: wait for one with both rates while the camera still sends)
        diag = last_diag(col, "camera back", lambda v: float(v["input_fps"]) > 1
                         and float(v["processed_fps"]) > 1)
    finally:
        stop(back)
    backs = col.msgs("/back/detections")
    assert all(m.camera == "back" and m.task.name == "bags" and m.header.frame_id == "back_optical"
               for m in backs)
    assert all(len(m.detections) == 2 and m.detections[0].label == "bag" for m in backs)
    assert all(m.camera == "front" and m.header.frame_id == "front_optical" for m in dets)
    # stamps are "now": latency is source stamp -> publish on the node clock
    for m in dets + backs:
        assert 0 < m.timing.latency_ms < 5000, m.timing
        assert m.timing.latency_ms >= m.timing.queue_ms
    assert float(diag["input_fps"]) > 1 and float(diag["processed_fps"]) > 1, diag
    assert 0 < float(diag["latency_p50_ms"]) <= float(diag["latency_p99_ms"]) < 5000, diag


def test_query_service(env):
    from photon_ros.srv import Query

    col, client = env["col"], env["query"]
    run_camera(col, "/front/detections", 1, "--topic", "/pt/front/image", "--fps", "5",
               "--stamp0", "800.0", "--count", "5")
    res = col.call(client, Query.Request(camera="front", skill="detect", object="cup",
                                         max_objects=2))
    assert res.success, res.message
    d = res.detections
    assert res.result_type == "detections" and d.task.name == "on_demand" and d.task.target == "cup"
    assert len(d.detections) == 2 and 800.0 <= stamp_of(d) < 802.0 and d.camera == "front"
    res = col.call(client, Query.Request(camera="front", skill="query", question="what is it?",
                                         max_tokens=5))
    assert res.success and res.result_type == "answer" and res.answer.tokens == 5
    assert res.answer.task.target == "what is it?"
    before = last_diag(col, "node")
    bad = [(Query.Request(camera="nope", skill="detect", object="cup"), "unknown camera"),
           (Query.Request(camera="front", skill="query", question="  "), "non-empty question"),
           (Query.Request(camera="front", skill="query", question="why? " * 400), "limit"),
           (Query.Request(camera="front", skill="segment", object="x"), "unknown skill")]
    for req, why in bad:
        res = col.call(client, req)
        assert not res.success and why in res.message, res.message
    # a deadline it cannot meet: 150 steps of >= 4 ms against 30 ms
    res = col.call(client, Query.Request(camera="front", skill="query", question="long?",
                                         max_tokens=150, deadline_ms=30.0))
    assert not res.success and "deadline" in res.message, res.message
    after = last_diag(col, "node", lambda v: int(v.get("invalid_requests", 0)) >=
                      int(before.get("invalid_requests", 0)) + 4)
    assert int(after["invalid_requests"]) >= int(before.get("invalid_requests", 0)) + 4
    assert env["node"].poll() is None


def test_stream_answer_with_feedback_and_cancel(env):
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient

    from photon_ros.action import StreamAnswer
    from photon_ros.msg import Answer

    col = env["col"]
    run_camera(col, "/front/detections", 1, "--topic", "/pt/front/image", "--fps", "5",
               "--stamp0", "900.0", "--count", "3")
    action = ActionClient(col.node, StreamAnswer, "/perception_node/stream_answer")
    assert action.wait_for_server(timeout_sec=30)
    settle_new_client(action)
    feedback: list = []
    goal = col.wait_future(action.send_goal_async(
        StreamAnswer.Goal(camera="front", skill="caption", caption_length="long", max_tokens=20),
        feedback_callback=lambda f: feedback.append(f.feedback)))
    assert goal.accepted
    res = col.wait_future(goal.get_result_async())
    assert res.status == GoalStatus.STATUS_SUCCEEDED, res.result.message
    a = res.result.answer
    assert res.result.success and a.finish_reason == Answer.FINISH_LENGTH and a.tokens == 20
    assert a.task.skill == "caption" and a.header.stamp.sec >= 900
    assert feedback and "".join(f.delta for f in feedback) == feedback[-1].partial_text
    assert a.text.startswith(feedback[-1].partial_text)
    assert [f.tokens for f in feedback] == sorted(f.tokens for f in feedback)

    # cancel mid-stream: the run stops between decode steps, partial answer, cancelled
    feedback.clear()
    goal = col.wait_future(action.send_goal_async(
        StreamAnswer.Goal(camera="front", skill="query", question="tell me everything",
                          max_tokens=190),
        feedback_callback=lambda f: feedback.append(f.feedback)))
    assert goal.accepted
    assert wait_for(lambda: len(feedback) >= 3, timeout=20)
    cancel = col.wait_future(goal.cancel_goal_async())
    assert cancel.goals_canceling
    res = col.wait_future(goal.get_result_async())
    assert res.status == GoalStatus.STATUS_CANCELED
    a = res.result.answer
    assert a.finish_reason == Answer.FINISH_CANCELLED and 3 <= a.tokens < 190, a

    # invalid goals end with a reason
    goal = col.wait_future(action.send_goal_async(
        StreamAnswer.Goal(camera="front", skill="query", question="")))
    res = col.wait_future(goal.get_result_async())
    assert res.status == GoalStatus.STATUS_ABORTED and "question" in res.result.message
    goal = col.wait_future(action.send_goal_async(
        StreamAnswer.Goal(camera="front", skill="detect", question="x")))
    res = col.wait_future(goal.get_result_async())
    assert res.status == GoalStatus.STATUS_ABORTED and "query or caption" in res.result.message
    action.destroy()


def test_set_tasks_and_parameter_updates_are_validated(env):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    from photon_ros.msg import TaskSpec
    from photon_ros.srv import SetTasks

    col = env["col"]
    set_tasks = col.node.create_client(SetTasks, "/perception_node/set_tasks")
    res = col.call(set_tasks, SetTasks.Request(camera="back", tasks=[
        TaskSpec(name="hands", skill="point", object="hand", max_objects=1)]))
    assert res.success and "hands" in res.message, res.message
    for req, why in [
            (SetTasks.Request(camera="back", tasks=[TaskSpec(name="x", skill="segment")]),
             "unknown skill 'segment'"),
            (SetTasks.Request(camera="back", tasks=[TaskSpec(name="x", skill="caption")] * 2),
             "twice"),
            (SetTasks.Request(camera="nope", tasks=[]), "unknown camera")]:
        res = col.call(set_tasks, req)
        assert not res.success and why in res.message, res.message
    col.clear("/back/detections")
    pts, _ = run_camera(col, "/back/points", 3, "--topic", "/pt/back/image", "--fps", "5")
    assert all(p.task.name == "hands" and len(p.points) == 1 for p in pts)
    assert not col.msgs("/back/detections")              # the rejected updates changed nothing

    setp = col.node.create_client(SetParameters, "/perception_node/set_parameters")

    def param(name, value):
        if isinstance(value, str):
            v = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
        else:
            v = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
        return Parameter(name=name, value=v)
    res = col.call(setp, SetParameters.Request(parameters=[param("front.people.skill", "segment")]))
    assert not res.results[0].successful and "segment" in res.results[0].reason
    res = col.call(setp, SetParameters.Request(parameters=[param("front.people.every_n", -2)]))
    assert not res.results[0].successful and "every_n" in res.results[0].reason
    # an invalid topic name is refused with the reason (it used to be accepted, and the
    # resubscription raised inside the parameter service: the node process died)
    res = col.call(setp, SetParameters.Request(parameters=[param("rel.topic", "bad topic")]))
    assert not res.results[0].successful and "not a valid ROS topic name" in res.results[0].reason
    res = col.call(setp, SetParameters.Request(parameters=[param("front.people.object", "dog")]))
    assert res.results[0].successful, res.results[0].reason
    col.clear("/front/detections")
    dets, _ = run_camera(col, "/front/detections", 2, "--topic", "/pt/front/image", "--fps", "5")
    assert all(d.task.target == "dog" for d in dets)
    # parameters rebuilt the config: back has its configured task again
    col.clear("/back/detections")
    run_camera(col, "/back/detections", 2, "--topic", "/pt/back/image", "--fps", "5")


def test_bad_inputs_are_counted_and_good_frames_still_served(env):
    col = env["col"]
    col.clear("/front/detections")
    col.clear("/comp/detections")
    comp = spawn_camera("--topic", "/pt/comp/image", "--type", "compressed", "--pattern", "bad",
                        "--fps", "5", "--stamp0", "1000.0")
    try:
        dets, _ = run_camera(col, "/front/detections", 6, "--topic", "/pt/front/image",
                             "--pattern", "bad", "--fps", "5", "--stamp0", "1000.0")
        assert wait_for(lambda: len(col.msgs("/comp/detections")) >= 3, timeout=20)
        # the compressed camera keeps sending until 3 of its bad frames were counted (best
        # effort, depth 1: a bad frame 10 ms before a good one may be replaced in the queue;
        # CI once stopped it after 4 frames with 2 counted)
        last_diag(col, "camera comp", lambda v: int(v.get("error.decode_failed", 0)) >= 3,
                  timeout=20)
    finally:
        comp_out = stop(comp)
    want = ("error.unknown_encoding", "error.short_data", "error.empty_image", "error.too_large")
    front = last_diag(col, "camera front", lambda v: all(int(v.get(k, 0)) >= 3 for k in want))
    assert all(int(front.get(k, 0)) >= 3 for k in want), front
    comp_d = last_diag(col, "camera comp", lambda v: int(v.get("error.decode_failed", 0)) >= 3)
    assert int(comp_d.get("error.decode_failed", 0)) >= 3, (comp_d, comp_out)
    # good frames after bad ones: results keep coming, for the newest frames
    assert stamp_of(dets[-1]) >= 1000.0 + 5 * 0.2
    assert all(len(d.detections) == 2 for d in col.msgs("/comp/detections"))
    assert env["node"].poll() is None


def test_clock_jump_back_resets_the_camera(env):
    col = env["col"]
    col.clear("/front/detections")
    # stamps 700.0 .. 701.0, then back to 700.0 (a bag loop), three times
    cam = spawn_camera("--topic", "/pt/front/image", "--pattern", "loop", "--loop-len", "6",
                       "--fps", "5", "--stamp0", "700.0", "--count", "18")
    try:
        cam.wait(30)
    finally:
        stop(cam)
    wait_for(lambda: len(col.msgs("/front/detections")) >= 14, timeout=10)
    dets = col.msgs("/front/detections")
    # without the reset the latest-frame policy would refuse every frame after the first loop
    assert len(dets) > 8, [stamp_of(d) for d in dets]
    assert sum(1 for d in dets if abs(stamp_of(d) - 700.2) < 1e-6) >= 2
    diag = last_diag(col, "camera front", lambda v: int(v["clock_jumps_back"]) >= 2)
    assert int(diag["clock_jumps_back"]) >= 2, diag


def test_camera_stops_and_restarts(env):
    col = env["col"]
    run_camera(col, "/back/detections", 2, "--topic", "/pt/back/image", "--fps", "5",
               "--stamp0", "now", "--count", "10")
    from diagnostic_msgs.msg import DiagnosticStatus
    arr_ok = wait_for(lambda: any(
        s.name.endswith("camera back") and "no frames for" in s.message
        and s.level == DiagnosticStatus.WARN
        for arr in col.msgs("/diagnostics")[-2:] for s in arr.status), timeout=10)
    assert arr_ok, "diagnostics did not report the stopped camera"
    col.clear("/back/detections")
    dets, _ = run_camera(col, "/back/detections", 3, "--topic", "/pt/back/image", "--fps", "5",
                         "--stamp0", "now")
    assert all(d.camera == "back" for d in dets)


def test_incompatible_qos_is_reported(env):
    col = env["col"]
    cam = spawn_camera("--topic", "/pt/rel/image", "--fps", "5", "--count", "15", "--wait", "0")
    try:
        diag = last_diag(col, "camera rel", lambda v: int(v["qos_incompatible"]) >= 1, timeout=20)
    finally:
        stop(cam)
    assert int(diag["qos_incompatible"]) >= 1, diag
    assert not col.msgs("/rel/detections")
    status = [s for s in col.msgs("/diagnostics")[-1].status if s.name.endswith("camera rel")][0]
    assert "incompatible QoS" in status.message
    # a reliable publisher is served
    run_camera(col, "/rel/detections", 2, "--topic", "/pt/rel/image", "--fps", "5", "--reliable")


def test_annotated_image_only_while_subscribed(env):
    from sensor_msgs.msg import Image

    col = env["col"]
    assert col.node.count_publishers("/back/annotated") == 1
    col.listen(Image, "/back/annotated")
    assert wait_for(lambda: col.node.count_subscribers("/back/annotated") >= 1, timeout=10)
    run_camera(col, "/back/annotated", 2, "--topic", "/pt/back/image", "--fps", "5",
               "--frame-id", "back_optical")
    img = col.msgs("/back/annotated")[-1]
    assert (img.width, img.height, img.encoding) == (W, H, "rgb8")
    assert img.header.frame_id == "back_optical" and len(img.data) == W * H * 3
