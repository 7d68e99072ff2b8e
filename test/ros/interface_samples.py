"""Filled samples of every photon_ros message, shared by both sides of the DDS tests."""
from __future__ import annotations

import math

from builtin_interfaces.msg import Time
from std_msgs.msg import Header

from photon_ros.msg import (Answer, BoundingBox2D, Detection, DetectionArray, ImagePoint,
                            NormalizedBox, PointArray, TaskInfo, TaskSpec, Timing)


def header(i: int = 0) -> Header:
    return Header(stamp=Time(sec=1_700_000_000 + i, nanosec=123_456_789), frame_id="cam_front_optical")


def timing() -> Timing:
    return Timing(engine_ms=12.5, queue_ms=0.75, latency_ms=20.25)


def detection_array(i: int = 0) -> DetectionArray:
    dets = [Detection(label="person", score=math.nan,
                      bbox=BoundingBox2D(center_x=320.0, center_y=240.0, size_x=64.0, size_y=128.0),
                      box=NormalizedBox(x_min=0.45, y_min=0.3666, x_max=0.55, y_max=0.6333)),
            Detection(label="person", score=0.5,
                      bbox=BoundingBox2D(center_x=10.0, center_y=20.0, size_x=4.0, size_y=8.0),
                      box=NormalizedBox(x_min=0.0125, y_min=0.0333, x_max=0.01875, y_max=0.05))]
    return DetectionArray(header=header(i), camera="front", model_id="vikhyatk/moondream2",
                          task=TaskInfo(name="people", skill="detect", target="person"),
                          image_width=640, image_height=480, detections=dets, timing=timing())


def point_array(i: int = 0) -> PointArray:
    pts = [ImagePoint(label="door", x=100.0, y=200.0, x_norm=100 / 640, y_norm=200 / 480)]
    return PointArray(header=header(i), camera="front", model_id="m",
                      task=TaskInfo(name="doors", skill="point", target="door"),
                      image_width=640, image_height=480, points=pts, timing=timing())


def answer(i: int = 0) -> Answer:
    return Answer(header=header(i), camera="front", model_id="m",
                  task=TaskInfo(name="ask", skill="query", target="Is the door open?"),
                  text="Yes, the door is open. ünïcødé ✓", finish_reason=Answer.FINISH_STOP,
                  tokens=9, timing=timing())


def task_spec(i: int = 0) -> TaskSpec:
    return TaskSpec(name="people", skill="detect", object="person", every_n=2, hz=0.0,
                    deadline_ms=150.0, max_objects=10, max_tokens=0, on_miss="cancel")


SAMPLES = {
    "detections": (DetectionArray, detection_array),
    "points": (PointArray, point_array),
    "answer": (Answer, answer),
    "task_spec": (TaskSpec, task_spec),
}


def same(a, b) -> bool:
    """Message equality that treats NaN == NaN (score is NaN where the model gives none)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "get_fields_and_field_types"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.get_fields_and_field_types())
    return a == b
