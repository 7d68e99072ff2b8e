"""The other side of the interface tests, run as a separate process.

    python interface_peer.py publisher   # publishes every sample message, 5 Hz
    python interface_peer.py server      # serves Query, SetTasks and the StreamAnswer action
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # before rclpy.init(): loopback only

import rclpy  # noqa: E402
from rclpy.action import ActionServer, CancelResponse, GoalResponse  # noqa: E402
from rclpy.callback_groups import ReentrantCallbackGroup  # noqa: E402
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402

import interface_samples as S  # noqa: E402
from photon_ros.action import StreamAnswer  # noqa: E402
from photon_ros.msg import Answer, TaskInfo  # noqa: E402
from photon_ros.srv import Query, SetTasks  # noqa: E402


def publisher(node: Node) -> None:
    pubs = {name: (node.create_publisher(cls, f"/photon_test/{name}", 10), make)
            for name, (cls, make) in S.SAMPLES.items()}
    count = [0]

    def tick():
        for pub, make in pubs.values():
            pub.publish(make(count[0]))
        count[0] += 1
    node.create_timer(0.2, tick)


def server(node: Node) -> None:
    group = ReentrantCallbackGroup()

    def on_query(req: Query.Request, res: Query.Response) -> Query.Response:
        if req.camera != "front":
            res.success, res.message = False, f"unknown camera {req.camera!r}"
            return res
        res.success, res.message, res.result_type = True, "", "detections"
        res.detections = S.detection_array()
        res.detections.task.target = req.object
        return res

    def on_set_tasks(req: SetTasks.Request, res: SetTasks.Response) -> SetTasks.Response:
        res.success = all(t.skill in ("detect", "point", "query", "caption") for t in req.tasks)
        res.message = f"{len(req.tasks)} tasks for {req.camera}" if res.success else "bad skill"
        return res

    def execute(goal_handle):
        words = [f"w{i}" for i in range(goal_handle.request.max_tokens or 40)]
        text = ""
        for i, w in enumerate(words):
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
                return StreamAnswer.Result(success=False, message="cancelled", answer=Answer(
                    text=text, finish_reason=Answer.FINISH_CANCELLED, tokens=i,
                    task=TaskInfo(skill="query", target=goal_handle.request.question)))
            delta = (" " if text else "") + w
            text += delta
            goal_handle.publish_feedback(
                StreamAnswer.Feedback(partial_text=text, delta=delta, tokens=i + 1))
            time.sleep(0.05)
        goal_handle.succeed()
        return StreamAnswer.Result(success=True, answer=Answer(
            text=text, finish_reason=Answer.FINISH_LENGTH, tokens=len(words),
            task=TaskInfo(skill="query", target=goal_handle.request.question)))

    node.create_service(Query, "/photon_test/query", on_query, callback_group=group)
    node.create_service(SetTasks, "/photon_test/set_tasks", on_set_tasks, callback_group=group)
    node._action = ActionServer(node, StreamAnswer, "/photon_test/stream_answer", execute,
                                goal_callback=lambda g: GoalResponse.ACCEPT,
                                cancel_callback=lambda g: CancelResponse.ACCEPT,
                                callback_group=group)


def main() -> None:
    role = sys.argv[1]
    rclpy.init()
    node = Node(f"photon_test_{role}")
    {"publisher": publisher, "server": server}[role](node)
    print(f"{role} ready", flush=True)
    executor = MultiThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
