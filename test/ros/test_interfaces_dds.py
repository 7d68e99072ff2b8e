"""Every photon_ros interface crosses real FastDDS between separate processes (loopback)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rclpy = pytest.importorskip("rclpy")

from rclpy.action import ActionClient  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402

import interface_samples as S  # noqa: E402
from photon_ros.action import StreamAnswer  # noqa: E402
from photon_ros.msg import Answer, TaskSpec  # noqa: E402
from photon_ros.srv import Query, SetTasks  # noqa: E402
from ros_env import settle_new_client, spawn, stop, wait_for  # noqa: E402


@pytest.fixture
def ros():
    assert os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = rclpy.create_node("photon_test_checker", context=ctx)
    executor = SingleThreadedExecutor(context=ctx)
    executor.add_node(node)
    yield node, (lambda: executor.spin_once(timeout_sec=0.05))
    executor.shutdown()
    node.destroy_node()
    rclpy.shutdown(context=ctx)


def test_every_message_crosses_processes(ros):
    node, spin = ros
    got: dict[str, object] = {}
    for name, (cls, _) in S.SAMPLES.items():
        node.create_subscription(cls, f"/photon_test/{name}",
                                 lambda msg, name=name: got.setdefault(name, msg), 10)
    peer = spawn("interface_peer.py", "publisher")
    try:
        ok = wait_for(lambda: len(got) == len(S.SAMPLES), timeout=30, spin=spin)
    finally:
        out = stop(peer)
    assert ok, f"received only {sorted(got)}; peer said: {out}"
    for name, (_, make) in S.SAMPLES.items():
        msg = got[name]
        stamp_sec = msg.header.stamp.sec if hasattr(msg, "header") else None
        expected = make(stamp_sec - 1_700_000_000) if stamp_sec is not None else make()
        assert S.same(msg, expected), f"{name} changed in transit:\n{msg}\n!=\n{expected}"
    # The source header passes through untouched; score NaN survives.
    assert got["detections"].header.frame_id == "cam_front_optical"
    assert got["detections"].header.stamp.nanosec == 123_456_789
    assert got["detections"].detections[0].score != got["detections"].detections[0].score


def _call(node, spin, client, request, timeout=20.0):
    assert wait_for(lambda: client.service_is_ready(), timeout=30, spin=spin), "service not found"
    settle_new_client(client)
    future = client.call_async(request)
    assert wait_for(future.done, timeout=timeout, spin=spin), "no response"
    return future.result()


def test_services_and_action_round_trip_with_cancel(ros):
    node, spin = ros
    peer = spawn("interface_peer.py", "server")
    try:
        query = node.create_client(Query, "/photon_test/query")
        res = _call(node, spin, query, Query.Request(camera="front", skill="detect", object="cup"))
        assert res.success and res.result_type == "detections"
        assert res.detections.task.target == "cup" and len(res.detections.detections) == 2
        res = _call(node, spin, query, Query.Request(camera="nope", skill="detect", object="cup"))
        assert not res.success and "nope" in res.message

        set_tasks = node.create_client(SetTasks, "/photon_test/set_tasks")
        res = _call(node, spin, set_tasks, SetTasks.Request(camera="front", tasks=[S.task_spec()]))
        assert res.success and res.message == "1 tasks for front"
        res = _call(node, spin, set_tasks,
                    SetTasks.Request(camera="front", tasks=[TaskSpec(name="x", skill="segment")]))
        assert not res.success

        action = ActionClient(node, StreamAnswer, "/photon_test/stream_answer")
        assert wait_for(lambda: action.server_is_ready(), timeout=30, spin=spin)
        settle_new_client(action)
        # A full streamed answer: feedback grows the text one delta at a time.
        feedback: list[StreamAnswer.Feedback] = []
        goal_f = action.send_goal_async(StreamAnswer.Goal(camera="front", skill="query",
                                                          question="what?", max_tokens=5),
                                        feedback_callback=lambda f: feedback.append(f.feedback))
        assert wait_for(goal_f.done, spin=spin) and goal_f.result().accepted
        result_f = goal_f.result().get_result_async()
        assert wait_for(result_f.done, spin=spin)
        result = result_f.result().result
        assert result.success and result.answer.text == "w0 w1 w2 w3 w4"
        assert result.answer.finish_reason == Answer.FINISH_LENGTH
        assert feedback and feedback[-1].partial_text == result.answer.text
        assert "".join(f.delta for f in feedback) == result.answer.text

        # Cancel mid-stream: the server stops early and reports a partial, cancelled answer.
        feedback.clear()
        goal_f = action.send_goal_async(StreamAnswer.Goal(camera="front", skill="query",
                                                          question="long?", max_tokens=400),
                                        feedback_callback=lambda f: feedback.append(f.feedback))
        assert wait_for(goal_f.done, spin=spin) and goal_f.result().accepted
        handle = goal_f.result()
        assert wait_for(lambda: len(feedback) >= 3, spin=spin)
        cancel_f = handle.cancel_goal_async()
        assert wait_for(cancel_f.done, spin=spin) and cancel_f.result().goals_canceling
        result_f = handle.get_result_async()
        assert wait_for(result_f.done, spin=spin)
        res = result_f.result()
        from action_msgs.msg import GoalStatus
        assert res.status == GoalStatus.STATUS_CANCELED
        assert res.result.answer.finish_reason == Answer.FINISH_CANCELLED
        assert 3 <= res.result.answer.tokens < 400
    finally:
        out = stop(peer)
    assert "server ready" in out
