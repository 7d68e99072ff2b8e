"""photon_core.TaskResult -> photon_ros messages (DetectionArray, PointArray, Answer).

The source image header is copied untouched (stamp and frame_id), so results can be matched
to their frames downstream. Boxes are given twice: in pixels of the source image shaped like
vision_msgs/BoundingBox2D (center + size), and as normalized corners (0..1). Moondream gives
no confidence, so every score is NaN.
"""
from __future__ import annotations

import functools
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


# -- vision_msgs (the standard detector output planners consume) ---------------------------
# Convention, per camera:
#   <camera>/detections_2d  vision_msgs/Detection2DArray: one Detection2D per box; bbox
#       center/size in pixels of the source image (theta 0); one hypothesis: class_id = the
#       object named in the task, score = the model's confidence where it gives one, else 1.0
#       (Moondream gives none: the detection is asserted, and score filters written for
#       detectors such as YOLO keep it); id = the task name.
#   <camera>/points_2d      vision_msgs/Detection2DArray: one Detection2D per point; bbox
#       center = the point in pixels, size 0 x 0; hypothesis as above.
# Both carry the source image header (stamp and frame_id) on the array and on each detection.
@functools.lru_cache(maxsize=1)
def vision_msgs_missing() -> str | None:
    """None when vision_msgs is importable, else why not."""
    try:
        from vision_msgs.msg import Detection2DArray  # noqa: F401
    except ImportError as e:
        return str(e) or type(e).__name__
    return None


def _score(v) -> float:
    v = float(v)
    return v if math.isfinite(v) else 1.0


def _vision_array(msg, items):
    """items: (center_x, center_y, size_x, size_y, label, score) in pixels."""
    from vision_msgs.msg import Detection2D, Detection2DArray, ObjectHypothesisWithPose

    out = Detection2DArray(header=msg.header)
    for cx, cy, sx, sy, label, score in items:
        v = Detection2D(header=msg.header, id=msg.task.name)
        v.bbox.center.position.x, v.bbox.center.position.y = float(cx), float(cy)
        v.bbox.size_x, v.bbox.size_y = float(sx), float(sy)
        hyp = ObjectHypothesisWithPose()
        hyp.hypothesis.class_id = label
        hyp.hypothesis.score = _score(score)
        v.results.append(hyp)
        out.detections.append(v)
    return out


def to_vision_msgs(msg: DetectionArray):
    """DetectionArray -> vision_msgs/Detection2DArray, or None when vision_msgs is missing
    (it is not on PyPI; a normal ROS install has it)."""
    if vision_msgs_missing() is not None:
        return None
    return _vision_array(msg, ((d.bbox.center_x, d.bbox.center_y, d.bbox.size_x, d.bbox.size_y,
                                d.label, d.score) for d in msg.detections))


def points_to_vision_msgs(msg: PointArray):
    """PointArray -> vision_msgs/Detection2DArray (0 x 0 boxes at the points), or None."""
    if vision_msgs_missing() is not None:
        return None
    return _vision_array(msg, ((p.x, p.y, 0.0, 0.0, p.label, float("nan")) for p in msg.points))


def stamp_to_s(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9
