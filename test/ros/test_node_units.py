"""Unit tests of the node's building blocks: image conversion, task configuration, message
building, cadence and the synchronous pipeline (no DDS)."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from builtin_interfaces.msg import Time  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from photon_core.task import Task, TaskResult  # noqa: E402
from photon_ros import image_conversion as ic  # noqa: E402
from photon_ros.msg import Answer, DetectionArray, PointArray, TaskSpec  # noqa: E402
from photon_ros.pipeline import Cadence, PerceptionPipeline  # noqa: E402
from photon_ros.result_messages import build_result, to_vision_msgs  # noqa: E402
from photon_ros.task_config import (ConfigError, PerceptionConfig, config_from_params,  # noqa: E402
                                    load_config, tasks_from_specs)

from node_helpers import moondream_available, tiny_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (5, 7, 3), dtype=np.uint8)


def make_image(encoding: str, rgb: np.ndarray = RGB, pad: int = 0) -> Image:
    h, w = rgb.shape[:2]
    if encoding == "rgb8":
        px = rgb
    elif encoding == "bgr8":
        px = rgb[:, :, ::-1]
    elif encoding == "rgba8":
        px = np.concatenate([rgb, np.full((h, w, 1), 9, np.uint8)], axis=2)
    elif encoding == "bgra8":
        px = np.concatenate([rgb[:, :, ::-1], np.full((h, w, 1), 9, np.uint8)], axis=2)
    elif encoding == "mono8":
        px = rgb[:, :, :1]
    else:
        raise AssertionError(encoding)
    rows = np.ascontiguousarray(px).reshape(h, -1)
    rows = np.concatenate([rows, np.full((h, pad), 77, np.uint8)], axis=1)
    msg = Image(height=h, width=w, encoding=encoding, step=rows.shape[1])
    msg.data = rows.tobytes()
    return msg


# -- image conversion ---------------------------------------------------------------------------
@pytest.mark.parametrize("pad", [0, 3, 16])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8", "mono8"])
def test_every_encoding_with_and_without_row_padding(encoding, pad):
    out = ic.image_to_rgb(make_image(encoding, pad=pad))
    assert out.shape == (5, 7, 3) and out.dtype == np.uint8
    want = np.repeat(RGB[:, :, :1], 3, axis=2) if encoding == "mono8" else RGB
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_color_encodings_are_zero_copy_views(encoding):
    msg = make_image(encoding, pad=4)
    out = ic.image_to_rgb(msg)
    assert np.shares_memory(out, np.frombuffer(msg.data, np.uint8))


def test_last_row_without_padding_is_accepted():
    msg = make_image("rgb8", pad=5)
    msg.data = bytes(msg.data)[:-5]
    np.testing.assert_array_equal(ic.image_to_rgb(msg), RGB)


@pytest.mark.parametrize("mutate, reason", [
    (lambda m: setattr(m, "encoding", "yuv422"), ic.REASON_UNKNOWN_ENCODING),
    (lambda m: setattr(m, "data", bytes(m.data)[:40]), ic.REASON_SHORT_DATA),
    (lambda m: (setattr(m, "width", 0), setattr(m, "height", 0)), ic.REASON_EMPTY),
    (lambda m: setattr(m, "step", 10), ic.REASON_BAD_STEP),
    (lambda m: (setattr(m, "width", 16384), setattr(m, "height", 16384),
                setattr(m, "step", 16384 * 3)), ic.REASON_TOO_LARGE),
])
def test_bad_images_raise_with_a_reason(mutate, reason):
    msg = make_image("rgb8")
    mutate(msg)
    with pytest.raises(ic.ImageConversionError) as e:
        ic.image_to_rgb(msg)
    assert e.value.reason == reason and isinstance(e.value, ValueError)
    assert str(e.value)


def test_max_pixels_is_a_parameter():
    msg = make_image("rgb8")
    with pytest.raises(ic.ImageConversionError, match="limit"):
        ic.image_to_rgb(msg, max_pixels=20)
    assert ic.image_to_rgb(msg, max_pixels=35).shape == (5, 7, 3)


def _compressed(fmt: str, rgb=RGB) -> CompressedImage:
    import cv2
    ok, buf = cv2.imencode("." + fmt, np.ascontiguousarray(rgb[:, :, ::-1]))
    assert ok
    msg = CompressedImage(format=fmt)
    msg.data = buf.tobytes()
    return msg


def test_compressed_png_exact_and_jpeg_close():
    np.testing.assert_array_equal(ic.compressed_to_rgb(_compressed("png")), RGB)
    smooth = np.tile(np.linspace(0, 255, 32, dtype=np.uint8)[None, :, None], (16, 1, 3))
    out = ic.compressed_to_rgb(_compressed("jpg", smooth))
    assert out.shape == (16, 32, 3) and np.abs(out.astype(int) - smooth).mean() < 8


def test_corrupt_and_oversized_compressed_images():
    bad = _compressed("jpg")
    bad.data = bytes(bad.data)[:20] + bytes(range(256)) * 2
    with pytest.raises(ic.ImageConversionError) as e:
        ic.compressed_to_rgb(bad)
    assert e.value.reason == ic.REASON_DECODE_FAILED
    empty = CompressedImage(format="jpeg")
    with pytest.raises(ic.ImageConversionError) as e:
        ic.compressed_to_rgb(empty)
    assert e.value.reason == ic.REASON_EMPTY
    # The size is read from the header: refused before decoding.
    png = _compressed("png")
    png.data = bytes(png.data)[:16] + (20000).to_bytes(4, "big") * 2 + bytes(png.data)[24:]
    with pytest.raises(ic.ImageConversionError) as e:
        ic.compressed_to_rgb(png)
    assert e.value.reason == ic.REASON_TOO_LARGE
    jpg = _compressed("jpg")
    with pytest.raises(ic.ImageConversionError) as e:
        ic.compressed_to_rgb(jpg, max_pixels=20)
    assert e.value.reason == ic.REASON_TOO_LARGE


# -- task configuration ---------------------------------------------------------------------------
def test_example_config_loads():
    cfg = load_config(REPO / "config" / "perception.yaml")
    front = cfg.camera("front")
    assert front.topic == "/camera/image_raw" and front.type == "image" and not front.qos_reliable
    assert [t.name for t in front.tasks] == ["people", "hands", "scene"]
    people = front.task("people")
    assert (people.skill, people.object, people.every_n) == ("detect", "person", 1)
    assert front.task("scene").every_n > 1 and front.task("scene").skill == "caption"
    task = people.to_task()
    assert isinstance(task, Task) and task.validate() and task.max_objects == people.max_objects


def _params(**task):
    t = {"skill": "detect", "object": "person", **task}
    return {"default_deadline_ms": 250.0, "cameras": ["cam1"],
            "cam1": {"topic": "/a/image", "tasks": ["t1"], "t1": t}}


def test_defaults_fill_zeros_and_overrides_apply():
    cfg = config_from_params(_params())
    t = cfg.camera("cam1").task("t1")
    assert t.deadline_ms == 250.0 and t.max_objects == cfg.default_max_objects
    assert t.on_miss == "cancel" and t.every_n == 1
    cfg = config_from_params({**_params(), "camera_topic": "/other/image"})
    assert cfg.camera("cam1").topic == "/other/image"
    flat = {"cameras": ["cam1"], "cam1.topic": "/x", "cam1.tasks": ["t1"], "cam1.t1.skill": "point",
            "cam1.t1.object": "cup", "cam1.t1.hz": 2}
    t = config_from_params(flat).camera("cam1").task("t1")
    assert t.skill == "point" and t.hz == 2.0


@pytest.mark.parametrize("params, match", [
    (_params(skill="segment"), "unknown skill 'segment'"),
    (_params(every_n=3, hz=2.0), "either every_n"),
    (_params(every_n=-1), "every_n"),
    (_params(on_miss="later"), "on_miss"),
    (_params(skill="query", object="", question=""), "non-empty question"),
    (_params(skill="query", question="x" * 5000), "limit"),
    (_params(skill="caption", caption_length="huge"), "caption_length"),
    (_params(colour="red"), "unknown key"),
    ({"cameras": ["cam1"], "cam1": {"topic": "/a", "tasks": ["t9"]}}, "not defined"),
    ({"cameras": ["cam1"]}, "no settings"),
    ({"cameras": ["bad-name"], "bad-name": {"topic": "/a"}}, "not valid"),
    ({"cameras": ["cam1"], "cam1": {"topic": "/a", "type": "video"}}, "type"),
    ({"cameras": ["cam1"], "cam1": {"topic": ""}}, "topic is empty"),
    ({"max_batch": 99}, "max_batch"),
    ({"engine": "turbo"}, "engine must be one of auto, reference, fast"),
    ({"megakernel": "pipe/x3"}, "megakernel"),
])
def test_invalid_configs_name_the_problem(params, match):
    with pytest.raises(ConfigError, match=match):
        config_from_params(params)


def test_megakernel_parameter_reaches_the_engine_options(monkeypatch):
    """`megakernel` (off | on | a variant string; YAML's on / off booleans too) is checked at
    configure and handed to load_engine as EngineOptions.megakernel."""
    import photon_core

    from photon_ros import live_pipeline
    assert config_from_params(_params()).megakernel == "auto"
    assert config_from_params({**_params(), "megakernel": "auto"}).megakernel == "auto"
    assert config_from_params({**_params(), "megakernel": True}).megakernel == "on"
    assert config_from_params({**_params(), "megakernel": False}).megakernel == "off"
    cfg = config_from_params({**_params(), "megakernel": "pipe_fma@8x1024/w4/s3/p2"})
    seen = {}
    monkeypatch.setattr(photon_core, "load_engine", lambda *a, **kw: seen.update(kw))
    live_pipeline.load_model(cfg)
    assert seen["options"].megakernel == "pipe_fma@8x1024/w4/s3/p2", seen


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("/**: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(tmp_path / "bad.yaml")


def test_task_specs_from_set_tasks():
    defaults = PerceptionConfig(default_deadline_ms=321.0, default_max_tokens=17)
    tasks = tasks_from_specs([TaskSpec(name="a", skill="caption"),
                              TaskSpec(name="b", skill="point", object="cup", every_n=4,
                                       deadline_ms=90.0, on_miss="finish")], defaults)
    assert tasks[0].caption_length == "normal" and tasks[0].deadline_ms == 321.0
    assert tasks[0].max_tokens == 17 and tasks[1].every_n == 4 and tasks[1].on_miss == "finish"
    with pytest.raises(ConfigError, match="unknown skill"):
        tasks_from_specs([TaskSpec(name="x", skill="segment")], defaults)
    with pytest.raises(ConfigError, match="twice"):
        tasks_from_specs([TaskSpec(name="x", skill="caption")] * 2, defaults)
    with pytest.raises(ConfigError, match="object"):
        tasks_from_specs([TaskSpec(name="x", skill="detect")], defaults)


def test_with_tasks_replaces_one_camera():
    cfg = config_from_params(_params())
    new = cfg.with_tasks("cam1", tasks_from_specs([TaskSpec(name="z", skill="caption")], cfg))
    assert [t.name for t in new.camera("cam1").tasks] == ["z"]
    assert [t.name for t in cfg.camera("cam1").tasks] == ["t1"]


# -- messages ---------------------------------------------------------------------------------------
def _header():
    return Header(stamp=Time(sec=1_700_000_123, nanosec=456_789), frame_id="cam_optical")


def test_detections_pixels_and_normalized_corners():
    res = TaskResult(Task("detect", object="person"),
                     {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6},
                                  {"x_min": -0.2, "y_min": 0.9, "x_max": 0.3, "y_max": 1.4}]},
                     tokens=7, engine_ms=3.5)
    msg = build_result(res, _header(), "front", "people", "md2", 640, 480)
    assert isinstance(msg, DetectionArray)
    assert msg.header.stamp.nanosec == 456_789 and msg.header.frame_id == "cam_optical"
    assert (msg.camera, msg.task.name, msg.task.skill, msg.task.target) == \
        ("front", "people", "detect", "person")
    assert (msg.model_id, msg.image_width, msg.image_height) == ("md2", 640, 480)
    d = msg.detections[0]
    assert d.label == "person" and math.isnan(d.score)
    assert (d.bbox.center_x, d.bbox.center_y) == pytest.approx((192.0, 192.0))
    assert (d.bbox.size_x, d.bbox.size_y) == pytest.approx((256.0, 192.0))
    assert (d.box.x_min, d.box.y_min, d.box.x_max, d.box.y_max) == pytest.approx((0.1, 0.2, 0.5, 0.6))
    clipped = msg.detections[1].box
    assert (clipped.x_min, clipped.y_max) == (0.0, 1.0)
    assert msg.timing.engine_ms == 3.5


def test_points_and_answers():
    res = TaskResult(Task("point", object="cup"), {"points": [{"x": 0.25, "y": 0.5}]})
    msg = build_result(res, _header(), "front", "cups", "md2", 100, 50)
    assert isinstance(msg, PointArray) and msg.points[0].label == "cup"
    assert (msg.points[0].x, msg.points[0].y, msg.points[0].x_norm) == (25.0, 25.0, 0.25)
    res = TaskResult(Task("caption", caption_length="short"), {"caption": "a cat"},
                     finish_reason="length", tokens=2)
    msg = build_result(res, _header(), "front", "scene", "md2", 100, 50)
    assert isinstance(msg, Answer) and msg.text == "a cat" and msg.finish_reason == "length"
    assert msg.task.target == "short" and msg.tokens == 2
    res = TaskResult(Task("query", question="what?"), {"answer": "x"}, finish_reason="deadline")
    assert build_result(res, _header(), "f", "q", "m", 1, 1).finish_reason == Answer.FINISH_DEADLINE


def test_vision_msgs_is_optional():
    res = TaskResult(Task("detect", object="person"),
                     {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6}]})
    msg = build_result(res, _header(), "front", "people", "md2", 640, 480)
    try:
        import vision_msgs  # noqa: F401
    except ImportError:
        assert to_vision_msgs(msg) is None
    else:
        v = to_vision_msgs(msg)
        assert v.detections[0].bbox.size_x == pytest.approx(256.0)


# -- cadence -------------------------------------------------------------------------------------
def test_every_n_and_hz_cadence():
    cfg = config_from_params({"cameras": ["c"], "c": {
        "topic": "/c", "tasks": ["a", "b", "h"],
        "a": {"skill": "detect", "object": "x"},
        "b": {"skill": "caption", "every_n": 3},
        "h": {"skill": "point", "object": "y", "hz": 10.0}}})
    p = PerceptionPipeline(cfg, model=None, model_id="m")
    runs = {"a": [], "b": [], "h": []}
    for i in range(12):                         # 30 fps stamps
        for t in p.due_tasks("c", i, 50.0 + i / 30):
            runs[t.name].append(i)
    assert runs["a"] == list(range(12))
    assert runs["b"] == [0, 3, 6, 9]
    assert runs["h"] == [0, 3, 6, 9]
    # stamps going back (bag loop): hz state restarts instead of waiting for the old stamps
    assert [t.name for t in p.due_tasks("c", 1, 50.0)] == ["a", "h"]
    with pytest.raises(ValueError, match="unknown camera"):
        p.due_tasks("nope", 0, 0.0)


def test_cadence_reset_per_camera():
    c = Cadence()
    cfg = config_from_params({"cameras": ["c"], "c": {"topic": "/c", "tasks": ["h"],
                                                       "h": {"skill": "caption", "hz": 1.0}}})
    tasks = cfg.camera("c").tasks
    assert c.due("c", tasks, 0, 10.0) and not c.due("c", tasks, 1, 10.5)
    c.reset("c")
    assert c.due("c", tasks, 2, 10.6)


# -- the synchronous pipeline with the tiny test model -----------------------------------------------
@pytest.mark.skipif(not moondream_available(), reason="photon_core.moondream not importable")
def test_process_frame_is_deterministic(tmp_path_factory):
    from photon_core import load_model

    model = load_model(str(tiny_model_dir(tmp_path_factory.getbasetemp())), progress=False)
    cfg = config_from_params({"cameras": ["front"], "front": {
        "topic": "/c", "tasks": ["people", "scene"],
        "people": {"skill": "detect", "object": "person", "max_objects": 3},
        "scene": {"skill": "caption", "every_n": 2, "max_tokens": 6}}})
    img = RNG.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    runs = []
    for _ in range(2):
        p = PerceptionPipeline(cfg, model)
        frames = [p.process_frame("front", _header(), img, i, now_s=1_700_000_124.0)
                  for i in range(3)]
        runs.append(frames)
    assert [len(f) for f in runs[0]] == [2, 1, 2]
    det, cap = runs[0][0]
    assert isinstance(det, DetectionArray) and isinstance(cap, Answer)
    assert det.header.stamp.sec == 1_700_000_123 and det.image_width == 64
    assert det.model_id == model.model_id and len(det.detections) <= 3
    assert det.timing.latency_ms == pytest.approx(1000.0 - 0.456789, abs=1e-3)
    assert cap.task.name == "scene" and cap.finish_reason in ("stop", "length")
    strip = lambda ms: [(type(m).__name__, str(getattr(m, "detections", "")), getattr(m, "text", ""))  # noqa: E731
                        for m in ms]
    assert [strip(f) for f in runs[0]] == [strip(f) for f in runs[1]]
    with pytest.raises(ValueError, match="HxWx3"):
        p.process_frame("front", _header(), img[:, :, 0], 0)


def test_deterministic_parameter():
    """`deterministic` (fast path without split-K atomics) parses as a bool, defaults off,
    and a non-bool value is refused with its name."""
    assert config_from_params({}).deterministic is False
    assert config_from_params({"deterministic": True}).deterministic is True
    with pytest.raises(ConfigError, match="deterministic"):
        config_from_params({"deterministic": "sometimes"})
