"""Review regressions: the node keeps serving through invalid topic names, callback
exceptions and lifecycle transitions racing the image callback; on-demand requests share the
frame (and its encoding) of the periodic tasks. In-process, no DDS traffic needed."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
rclpy = pytest.importorskip("rclpy")

from sensor_msgs.msg import Image  # noqa: E402

from photon_ros import image_conversion  # noqa: E402
from photon_ros import perception_node as pn  # noqa: E402
from photon_ros.executor import InlineGroupExecutor  # noqa: E402
from photon_ros.task_config import ConfigError, config_from_params  # noqa: E402
from fake_live import activate_with_fakes  # noqa: E402

PARAMS = {"cameras": ["front"],
          "front": {"topic": "/rb/front/image", "tasks": ["people"],
                    "people": {"skill": "detect", "object": "person"}}}


@pytest.fixture
def ctx():
    c = rclpy.Context()
    rclpy.init(context=c)
    yield c
    rclpy.try_shutdown(context=c)


@pytest.mark.parametrize("topic", ["bad topic", "/cam/1image", "/cam/"])
def test_invalid_topic_names_are_config_errors(topic):
    with pytest.raises(ConfigError, match="not a valid ROS topic name"):
        config_from_params({**PARAMS, "front": {**PARAMS["front"], "topic": topic}})
    with pytest.raises(ConfigError, match="camera_topic.*not a valid ROS topic name"):
        config_from_params({**PARAMS, "camera_topic": topic})


def test_executor_reports_callback_exceptions_and_keeps_spinning(ctx):
    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

    node = rclpy.create_node("rb_executor", context=ctx)
    inline = MutuallyExclusiveCallbackGroup()
    errors, calls = [], {"pool": 0, "inline": 0}

    def boom(where):
        calls[where] += 1
        raise RuntimeError(where)
    t1 = node.create_timer(0.01, lambda: boom("pool"))
    t2 = node.create_timer(0.01, lambda: boom("inline"), callback_group=inline)
    ex = InlineGroupExecutor(inline, num_threads=2, context=ctx, on_error=errors.append)
    ex.add_node(node)
    try:
        end = time.monotonic() + 5
        while time.monotonic() < end and not (calls["pool"] >= 3 and calls["inline"] >= 3):
            ex.spin_once(timeout_sec=0.05)          # raised before: the node's spin ended
    finally:
        node.destroy_timer(t1)
        node.destroy_timer(t2)
        ex.shutdown()
        node.destroy_node()
    assert calls["pool"] >= 3 and calls["inline"] >= 3
    assert {str(e) for e in errors} == {"pool", "inline"}


@pytest.mark.parametrize("inline", [True, False])
def test_a_shutdown_racing_spin_once_ends_spin_cleanly(inline):
    """SIGTERM mid-stream (CI, test_node_faults): rclpy's signal handler shut the context down
    between spin()'s check of it and the wait set's creation, and rcl's "context is not valid"
    error ended the node with a traceback and exit code 1. Here the shutdown comes first."""
    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

    c = rclpy.Context()
    rclpy.init(context=c)
    node = rclpy.create_node("rb_shutdown_race", context=c)
    group = MutuallyExclusiveCallbackGroup()
    ex = InlineGroupExecutor(group, num_threads=2, context=c)
    if not inline:
        ex.inline_group = None                   # the plain pool's path
    ex.add_node(node)
    try:
        ex.spin_once(timeout_sec=0.01)
        rclpy.shutdown(context=c)
        ex._spin_once_impl(0.01)                 # raised RCLError before
        ex.spin()                                # returns: the context is no longer ok
    finally:
        ex.shutdown()
        node.destroy_node()


def _pool_tasks_in_flight(ctx, name, n, raises):
    """A node whose reentrant timer's pool tasks block until `go` is set, then raise the
    next of `raises`; spun until n such tasks are in flight (unchecked by spin_once)."""
    import threading

    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup

    node = rclpy.create_node(name, context=ctx)
    errors, go, it = [], threading.Event(), iter(raises)

    def slow():
        go.wait(5)                 # still running when spin_once checks its futures
        raise next(it)
    timer = node.create_timer(0.01, slow, callback_group=ReentrantCallbackGroup())
    ex = InlineGroupExecutor(MutuallyExclusiveCallbackGroup(), num_threads=2, context=ctx,
                             on_error=errors.append)
    ex.add_node(node)
    end = time.monotonic() + 5
    while len(ex._futures) < n and time.monotonic() < end:
        ex.spin_once(timeout_sec=0.05)
    assert len(ex._futures) == n and not errors
    return node, timer, ex, errors, go


def test_shutdown_hands_unchecked_pool_errors_over_and_drops_shutdown_ones(ctx):
    """A pool task that finished after spin() last looked: its exception reaches on_error at
    shutdown; one that failed on an entity the shutdown destroyed (InvalidHandle) is
    dropped. Before, both stayed unretrieved and rclpy printed "The following exception was
    never retrieved" at exit."""
    from rclpy.exceptions import InvalidHandle

    node, timer, ex, errors, go = _pool_tasks_in_flight(
        ctx, "rb_shutdown_pool", 2,
        [RuntimeError("late"), InvalidHandle("cannot use Destroyable")])
    go.set()
    ex.shutdown()
    node.destroy_timer(timer)
    node.destroy_node()
    assert [str(e) for e in errors] == ["late"] and not ex._futures


def test_errors_of_a_shut_down_context_are_not_reported():
    """SIGTERM mid-stream (CI, test_node_fairness): the diagnostics timer's publish, running in
    the pool, failed with "publisher's context is invalid" once the context was shut down;
    executor.shutdown() handed that to the node's error log (a traceback at every stop).
    rcl errors of a context already shut down are the shutdown's, not a callback's."""
    from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

    c = rclpy.Context()
    rclpy.init(context=c)
    node, timer, ex, errors, go = _pool_tasks_in_flight(
        c, "rb_shutdown_rcl", 1,
        [_rclpy.RCLError("Failed to publish: publisher's context is invalid")])
    rclpy.shutdown(context=c)
    go.set()
    ex.shutdown()
    node.destroy_timer(timer)
    node.destroy_node()
    assert errors == [] and not ex._futures


def active_node(ctx):
    return activate_with_fakes(pn.PerceptionNode("rb_node", context=ctx), PARAMS)


def rgb8(stamp_s: float) -> Image:
    msg = Image(height=4, width=6, encoding="rgb8", step=18)
    msg.data = np.zeros(4 * 18, np.uint8).tobytes()
    msg.header.stamp.sec, msg.header.stamp.nanosec = int(stamp_s), int((stamp_s % 1) * 1e9)
    msg.header.frame_id = "cam"
    return msg


def test_image_callback_survives_a_concurrent_deactivate(ctx, monkeypatch):
    node = active_node(ctx)
    sched = node.live.scheduler
    real = image_conversion.image_to_rgb

    def convert_while_deactivating(msg, max_pixels):
        node.live, node.config = None, None           # deactivate + cleanup on a pool thread
        return real(msg, max_pixels)
    monkeypatch.setattr(image_conversion, "image_to_rgb", convert_while_deactivating)
    try:
        node.cameras.on_image("front", rgb8(10.0))    # AttributeError on None before
        assert len(sched.submitted) == 1              # went to the scheduler it started with
    finally:
        node.destroy_node()


def test_on_demand_request_shares_the_periodic_frame(ctx):
    node = active_node(ctx)
    sched = node.live.scheduler
    try:
        node.cameras.on_image("front", rgb8(10.0))
        periodic = sched.submitted[-1]
        st = node.cameras.get("front")
        st.latest.arrival -= 0.25                     # the frame arrived 250 ms ago
        t0 = time.monotonic()
        node.on_demand.submit("front", {"skill": "caption"}, 1000.0)
        od = sched.submitted[-1]
        assert od["kind"] == "on_demand"
        # same frame key as the periodic tasks: the scheduler shares frame and encoding
        assert (od["stream"], od["stamp"]) == (periodic["stream"], periodic["stamp"])
        assert od["capture_time"] == st.latest.arrival
        # ... while the deadline still counts from the request
        deadline = od["capture_time"] + od["tasks"][0].deadline_s
        assert t0 + 1.0 - 0.01 <= deadline <= time.monotonic() + 1.0 + 0.01
    finally:
        node.destroy_node()


def test_unknown_camera_replies_quote_a_bounded_name(ctx):
    """Query / SetTasks / StreamAnswer with an unknown camera name of a megabyte: the reply
    (and the log line) quotes a cut name, not all of it, and still says which cameras exist."""
    from photon_ros.srv import Query, SetTasks

    node = pn.PerceptionNode("rb_unknown_cam", context=ctx)
    try:
        node.config = config_from_params(PARAMS)
        node.cameras.reset(["front"])
        node.active, node.live = True, object()      # past the "not active" check
        for name in ("x" * 1_000_000, "nope"):
            res = node.on_demand.on_query(
                Query.Request(camera=name, skill="detect", object="cup"), Query.Response())
            res2 = node.on_demand.on_set_tasks(SetTasks.Request(camera=name, tasks=[]),
                                               SetTasks.Response())
            for r in (res, res2):
                assert not r.success and "unknown camera" in r.message
                assert "cameras: front" in r.message
                assert len(r.message) <= 160, len(r.message)     # the name cut to 80
            if name == "nope":
                assert "'nope'" in res.message and "'nope'" in res2.message
        assert node.counts["invalid_requests"] == 4
    finally:
        node.active, node.live = False, None
        node.destroy_node()
