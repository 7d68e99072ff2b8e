"""photon_core.TaskResult -> photon_ros messages (DetectionArray, PointArray, Answer).

The source image header is copied untouched (stamp and frame_id), so results can be matched
to their frames downstream. Boxes are given twice: in pixels of the source image shaped like
vision_msgs/BoundingBox2D (center + size), and as normalized corners (0..1). Moondream gives
no confidence, so every score is NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from photon_core.task import TaskResult

from photon_ros.msg import (Answer, BoundingBox2D, Detection, DetectionArray, ImagePoint,
                            NormalizedBox, PointArray, TaskInfo, Timing)

RESULT_TYPES = {"detect": "detections", "point": "points", "query": "answer", "caption": "answer"}


@dataclass
class ResultTiming:
    engine_ms: float = 0.0
    queue_ms: float = 0.0
    latency_ms: float = 0.0

    def to_msg(self) -> Timing:
        return Timing(engine_ms=float(self.engine_ms), queue_ms=float(self.queue_ms),
                      latency_ms=float(self.latency_ms))


def _clip01(v) -> float:
    v = float(v)
    if not math.isfinite(v):
        return 0.0
    return min(1.0, max(0.0, v))


def task_info(task_name: str, result_or_task) -> TaskInfo:
    task = getattr(result_or_task, "task", result_or_task)
    return TaskInfo(name=task_name, skill=task.skill, target=task.target)


def build_detections(result: TaskResult, header, camera: str, task_name: str, model_id: str,
                     width: int, height: int, timing: ResultTiming | None = None) -> DetectionArray:
    msg = DetectionArray(header=header, camera=camera, task=task_info(task_name, result),
                         model_id=model_id, image_width=int(width), image_height=int(height))
    label = result.task.object
    dets = []
    for o in result.output.get("objects", []):
        x0, y0, x1, y1 = (_clip01(o["x_min"]), _clip01(o["y_min"]), _clip01(o["x_max"]),
                          _clip01(o["y_max"]))
        x0, x1 = min(x0, x1), max(x0, x1)
        y0, y1 = min(y0, y1), max(y0, y1)
        dets.append(Detection(
            label=label, score=float("nan"),
            bbox=BoundingBox2D(center_x=(x0 + x1) / 2 * width, center_y=(y0 + y1) / 2 * height,
                               size_x=(x1 - x0) * width, size_y=(y1 - y0) * height),
            box=NormalizedBox(x_min=x0, y_min=y0, x_max=x1, y_max=y1)))
    msg.detections = dets
    msg.timing = (timing or ResultTiming()).to_msg()
    return msg


def build_points(result: TaskResult, header, camera: str, task_name: str, model_id: str,
                 width: int, height: int, timing: ResultTiming | None = None) -> PointArray:
    msg = PointArray(header=header, camera=camera, task=task_info(task_name, result),
                     model_id=model_id, image_width=int(width), image_height=int(height))
    label = result.task.object
    pts = []
    for p in result.output.get("points", []):
        x, y = _clip01(p["x"]), _clip01(p["y"])
        pts.append(ImagePoint(label=label, x=x * width, y=y * height, x_norm=x, y_norm=y))
    msg.points = pts
    msg.timing = (timing or ResultTiming()).to_msg()
    return msg


def build_answer(result: TaskResult, header, camera: str, task_name: str, model_id: str,
                 timing: ResultTiming | None = None) -> Answer:
    text = result.output.get("answer", result.output.get("caption", ""))
    return Answer(header=header, camera=camera, task=task_info(task_name, result),
                  model_id=model_id, text=str(text), finish_reason=str(result.finish_reason),
                  tokens=max(0, int(result.tokens)), timing=(timing or ResultTiming()).to_msg())


def build_result(result: TaskResult, header, camera: str, task_name: str, model_id: str,
                 width: int, height: int, timing: ResultTiming | None = None):
    """The message for any skill: DetectionArray, PointArray or Answer."""
    skill = result.task.skill
    if timing is None:
        timing = ResultTiming(engine_ms=result.engine_ms)
    if skill == "detect":
        return build_detections(result, header, camera, task_name, model_id, width, height, timing)
    if skill == "point":
        return build_points(result, header, camera, task_name, model_id, width, height, timing)
    if skill in ("query", "caption"):
        return build_answer(result, header, camera, task_name, model_id, timing)
    raise ValueError(f"unknown skill {skill!r}")


def to_vision_msgs(msg: DetectionArray):
    """DetectionArray -> vision_msgs/Detection2DArray, or None when vision_msgs is missing
    (it is not on PyPI; a normal ROS install has it)."""
    try:
        from vision_msgs.msg import Detection2D, Detection2DArray, ObjectHypothesisWithPose
    except ImportError:
        return None
    out = Detection2DArray(header=msg.header)
    for d in msg.detections:
        v = Detection2D(header=msg.header)
        v.bbox.center.position.x = d.bbox.center_x
        v.bbox.center.position.y = d.bbox.center_y
        v.bbox.size_x, v.bbox.size_y = d.bbox.size_x, d.bbox.size_y
        hyp = ObjectHypothesisWithPose()
        hyp.hypothesis.class_id = d.label
        hyp.hypothesis.score = float("nan")
        v.results.append(hyp)
        out.detections.append(v)
    return out


def stamp_to_s(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9
