"""On-demand requests of the perception node: the `~/query` and `~/set_tasks` services and
the `~/stream_answer` action. A request runs against the latest frame of its camera (sharing
that frame and its encoding with the periodic tasks still open on it); handlers wait for
their outcome on pool threads (reentrant group), never holding up images."""
from __future__ import annotations

import math
import queue
import threading
import time

from rclpy.action import ActionServer, CancelResponse, GoalResponse

from photon_core.task import cut_message
from photon_ros.action import StreamAnswer
from photon_ros.msg import Answer
from photon_ros.result_messages import ResultTiming, build_answer, stamp_to_s
from photon_ros.srv import Query, SetTasks
from photon_ros.task_config import make_task, tasks_from_specs


MAX_QUOTED_CHARS = 80      # what a reply quotes of a name the caller sent


def unknown_camera(camera: str, names) -> str:
    """The reply to an unknown camera name: the name quoted, cut to MAX_QUOTED_CHARS (a
    request may carry megabytes), and the cameras there are."""
    quoted = cut_message(repr(camera), MAX_QUOTED_CHARS)
    return cut_message(f"unknown camera {quoted}; cameras: {', '.join(names) or 'none'}")


class OnDemand:
    """The services and the action of an active node (`start` / `stop`). `node` provides
    config, live, active, cameras, counts, warn_throttled, now_s, set_config."""

    def __init__(self, node, group):
        self.node, self.group = node, group
        self._services: list = []
        self._action = None

    def start(self) -> None:
        node = self.node
        self._services = [
            node.create_service(Query, "~/query", self.on_query, callback_group=self.group),
            node.create_service(SetTasks, "~/set_tasks", self.on_set_tasks,
                                callback_group=self.group)]
        self._action = ActionServer(node, StreamAnswer, "~/stream_answer", self.on_stream,
                                    goal_callback=lambda g: GoalResponse.ACCEPT,
                                    cancel_callback=lambda g: CancelResponse.ACCEPT,
                                    callback_group=self.group)

    def stop(self) -> None:
        for srv in self._services:
            self.node.destroy_service(srv)
        self._services = []
        if self._action is not None:
            self._action.destroy()
            self._action = None

    def submit(self, camera: str, d: dict, deadline_ms: float, stream=None, cancelled=None):
        """Validate and submit an on-demand task against the latest frame of `camera`.
        Returns (task_config, task, frame, done event, outcome box, deadline_ms, live pipeline)
        or raises ValueError with the reason."""
        node = self.node
        cfg, live = node.config, node.live
        if not node.active or live is None or cfg is None:
            raise ValueError("the node is not active")
        st = node.cameras.get(camera)
        if st is None:
            raise ValueError(unknown_camera(camera, cfg.camera_names))
        frame = st.latest
        if frame is None:
            raise ValueError(f"no frame received yet from camera {camera!r}")
        deadline_ms = float(deadline_ms) or cfg.on_demand_deadline_ms
        if not math.isfinite(deadline_ms) or deadline_ms < 0:
            raise ValueError(f"deadline_ms must be >= 0, got {deadline_ms}")
        tc = make_task("on_demand", d, cfg, "request", caps=node.capabilities)
        from photon_core.scheduler import ON_DEMAND, TaskSpec as SchedSpec

        task = tc.to_task()
        done, box = threading.Event(), {}

        def on_result(outcome):
            box["outcome"] = outcome
            done.set()
        if stream is not None or cancelled is not None:
            live.engine.hook(task, stream=stream, cancelled=cancelled)
        self.node.counts["on_demand_requests"] += 1
        # The frame's own key: while periodic tasks of this frame are open in the scheduler,
        # the request shares their frame and its image encoding. Deadlines count from the
        # frame's capture time there, so the frame's age is added: this deadline still counts
        # from the request.
        age_s = max(0.0, time.monotonic() - frame.arrival)
        live.scheduler.submit_frame(camera, frame.key, live.encode_input(camera, frame.image),
                           [SchedSpec("on_demand", task, deadline_ms / 1e3 + age_s, "cancel")],
                           kind=ON_DEMAND, on_result=on_result, capture_time=frame.arrival)
        return tc, task, frame, done, box, deadline_ms, live

    def invalid(self, what: str, reason: str) -> None:
        self.node.counts["invalid_requests"] += 1
        self.node.warn_throttled(("node", what), f"{what} refused: {reason}")

    def on_query(self, req: Query.Request, res: Query.Response) -> Query.Response:
        d = {"skill": req.skill, "object": req.object, "question": req.question,
             "caption_length": req.caption_length, "max_objects": req.max_objects,
             "max_tokens": req.max_tokens}
        try:
            tc, task, frame, done, box, deadline_ms, live = self.submit(req.camera, d, req.deadline_ms)
        except ValueError as e:
            self.invalid("query", str(e))
            res.success, res.message = False, str(e)
            return res
        if not done.wait(deadline_ms / 1e3 + 10.0):
            res.success, res.message = False, f"no result within {deadline_ms:.0f} ms + 10 s"
            return res
        o = box["outcome"]
        status = str(o.status)
        kind = {"detect": "detections", "point": "points"}.get(tc.skill, "answer")
        res.result_type = kind
        if o.result is not None and live is not None:
            h, w = frame.image.shape[:2]
            stamp_s = stamp_to_s(frame.header.stamp)
            msg = live.pipeline.message_for(
                req.camera, "on_demand", o.result, frame.header, w, h,
                engine_ms=o.engine_ms + o.timings.get("encode_ms", 0.0), queue_ms=o.queue_ms,
                latency_ms=(self.node.now_s() - stamp_s) * 1e3)
            setattr(res, kind, msg)
        if status == "done":
            res.success, res.message = True, ""
        elif status == "deadline":
            res.success, res.message = False, f"deadline of {deadline_ms:.0f} ms passed (partial result)"
        elif status == "skipped":
            res.success, res.message = False, (f"cannot finish within the deadline of "
                                               f"{deadline_ms:.0f} ms (admission control)")
        else:
            res.success, res.message = False, f"{status}: {o.error}".rstrip(": ")
        return res

    def on_set_tasks(self, req: SetTasks.Request, res: SetTasks.Response) -> SetTasks.Response:
        cfg = self.node.config
        try:
            if cfg is None:
                raise ValueError("the node is not configured")
            if req.camera not in cfg.camera_names:
                raise ValueError(unknown_camera(req.camera, cfg.camera_names))
            tasks = tasks_from_specs(req.tasks, cfg, req.camera, caps=self.node.capabilities)
            new = cfg.with_tasks(req.camera, tasks)
        except ValueError as e:
            self.invalid("set_tasks", str(e))
            res.success, res.message = False, str(e)
            return res
        self.node.set_config(new)
        res.success = True
        res.message = f"{len(tasks)} tasks for {req.camera}: " + ", ".join(
            f"{t.name} ({t.skill})" for t in tasks)
        self.node.get_logger().info(f"set_tasks: {res.message}")
        return res

    def on_stream(self, goal_handle):
        req = goal_handle.request
        deltas: queue.Queue = queue.Queue()
        cancel = threading.Event()
        d = {"skill": req.skill, "question": req.question, "caption_length": req.caption_length,
             "max_tokens": req.max_tokens}
        try:
            if req.skill not in ("query", "caption"):
                raise ValueError("stream_answer runs query or caption, not "
                                 f"{cut_message(repr(req.skill), MAX_QUOTED_CHARS)}")
            tc, task, frame, done, box, deadline_ms, live = self.submit(
                req.camera, d, req.deadline_ms, stream=lambda t, n: deltas.put((t, n)),
                cancelled=cancel.is_set)
        except ValueError as e:
            self.invalid("stream_answer", str(e))
            goal_handle.abort()
            return StreamAnswer.Result(success=False, message=str(e))
        text = ""
        limit = time.monotonic() + deadline_ms / 1e3 + 10.0
        while True:
            if goal_handle.is_cancel_requested:
                cancel.set()
            if time.monotonic() > limit:
                cancel.set()
            try:
                delta, steps = deltas.get(timeout=0.02)
            except queue.Empty:
                if done.is_set() and deltas.empty():
                    break
                continue
            text += delta
            goal_handle.publish_feedback(StreamAnswer.Feedback(partial_text=text, delta=delta,
                                                               tokens=steps))
        if live is not None and live.engine is not None:
            live.engine.unhook(task)
        o = box["outcome"]
        status = str(o.status)
        h, w = frame.image.shape[:2]
        answer = Answer()
        if o.result is not None:
            stamp_s = stamp_to_s(frame.header.stamp)
            answer = build_answer(o.result, frame.header, req.camera, "on_demand",
                                  live.pipeline.model_id if live is not None else "",
                                  ResultTiming(o.engine_ms + o.timings.get("encode_ms", 0.0),
                                               o.queue_ms, (self.node.now_s() - stamp_s) * 1e3))
        elif status == "cancelled":
            answer.finish_reason = Answer.FINISH_CANCELLED
        if goal_handle.is_cancel_requested:
            if status != "done" or not answer.finish_reason:
                answer.finish_reason = Answer.FINISH_CANCELLED
            goal_handle.canceled()
            return StreamAnswer.Result(success=False, message="cancelled", answer=answer)
        if status == "done" and answer.finish_reason in (Answer.FINISH_STOP, Answer.FINISH_LENGTH):
            goal_handle.succeed()
            return StreamAnswer.Result(success=True, message="", answer=answer)
        if status == "done":          # stopped by our own time limit
            status = "deadline"
        goal_handle.abort()
        msg = {"deadline": f"deadline of {deadline_ms:.0f} ms passed (partial answer)",
               "skipped": f"cannot finish within the deadline of {deadline_ms:.0f} ms"}.get(
                   status, f"{status}: {o.error}".rstrip(": "))
        return StreamAnswer.Result(success=False, message=msg, answer=answer)
