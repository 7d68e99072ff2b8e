"""Fuzzing what comes from outside (hypothesis): sensor_msgs/Image and CompressedImage
conversion, the parameters/YAML/SetTasks parsing, and bag reading. Every input either works
or raises the module's clear error type (ImageConversionError with a counter reason,
ConfigError, BagError) -- never another exception, never a hang."""
from __future__ import annotations

import math
import struct
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from photon_ros.image_conversion import (REASONS, ImageConversionError,  # noqa: E402
                                         compressed_to_rgb, image_to_rgb)
from photon_ros.task_config import (ConfigError, PerceptionConfig,  # noqa: E402
                                    config_from_params, load_config, make_task, tasks_from_specs)

ENCODINGS = ["rgb8", "bgr8", "rgba8", "bgra8", "mono8", "8UC1", "8UC3", "RGB8", " bgr8 ", "mono16",
             "yuv422", "", "16UC1", "rgb16", "bayer_rggb8", "\x00", "32FC1"]
MAX_PIXELS = 4_000_000


def _img(width, height, step, encoding, data):
    return SimpleNamespace(width=width, height=height, step=step, encoding=encoding,
                           data=data, is_bigendian=0)


@settings(max_examples=600, deadline=None)
@given(width=st.one_of(st.integers(0, 70), st.integers(2 ** 31 - 2, 2 ** 32 - 1)),
       height=st.one_of(st.integers(0, 70), st.integers(2 ** 16, 2 ** 32 - 1)),
       step=st.one_of(st.integers(0, 300), st.integers(2 ** 31, 2 ** 32 - 1)),
       encoding=st.one_of(st.sampled_from(ENCODINGS), st.text(max_size=12)),
       extra=st.integers(-400, 400), seed=st.integers(0, 2 ** 16))
def test_image_conversion_never_crashes(width, height, step, encoding, extra, seed):
    """Any header + any amount of data: an HxWx3 uint8 array of the header's size, or
    ImageConversionError with a known reason (it becomes a diagnostics counter)."""
    need = max(0, min(step * height, 1 << 18) + extra)
    data = np.random.default_rng(seed).bytes(need)
    msg = _img(width, height, step, encoding, data)
    try:
        rgb = image_to_rgb(msg, MAX_PIXELS)
    except ImageConversionError as e:
        assert e.reason in REASONS and str(e)
        return
    assert rgb.shape == (height, width, 3) and rgb.dtype == np.uint8
    np.asarray(rgb).sum()                      # every pixel is really readable (no bad strides)


def test_image_conversion_values():
    """rgb8 with padding, bgr8, mono8: the pixels come out in RGB order."""
    rgb = np.random.default_rng(1).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    padded = np.concatenate([rgb.reshape(5, 21), np.zeros((5, 3), np.uint8)], 1).tobytes()
    assert (image_to_rgb(_img(7, 5, 24, "rgb8", padded)) == rgb).all()
    assert (image_to_rgb(_img(7, 5, 21, "bgr8", rgb[:, :, ::-1].tobytes())) == rgb).all()
    gray = rgb[:, :, 0]
    out = image_to_rgb(_img(7, 5, 7, "mono8", gray.tobytes()))
    assert (out == gray[:, :, None]).all()


def _png(width, height, body=b""):
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + body)


def _good_jpeg():
    import cv2
    ok, buf = cv2.imencode(".jpg", np.full((24, 32, 3), 120, np.uint8))
    return buf.tobytes()


def _good_png():
    import cv2
    ok, buf = cv2.imencode(".png", np.full((24, 32, 3), 7, np.uint8))
    return buf.tobytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(["jpeg", "png", "random", "png_bomb", "empty"]),
       cut=st.floats(0, 1), flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)),
                                           max_size=8),
       fmt=st.one_of(st.sampled_from(["jpeg", "png", "rgb8; jpeg compressed bgr8", ""]),
                     st.text(max_size=20)))
def test_compressed_conversion_never_crashes(base, cut, flips, fmt):
    """Truncated, bit-flipped, random and size-bomb streams: an RGB array within the pixel
    limit, or ImageConversionError (decode_failed / too_large / empty_image)."""
    data = {"jpeg": _good_jpeg, "png": _good_png, "random": lambda: np.random.default_rng(3).bytes(300),
            "png_bomb": lambda: _png(100_000, 100_000, b"\x00" * 64), "empty": lambda: b""}[base]()
    data = bytearray(data[: max(1, int(len(data) * cut))] if data and cut < 1 else data)
    for pos, val in flips:
        if data:
            data[pos % len(data)] = val
    msg = SimpleNamespace(format=fmt, data=bytes(data))
    try:
        rgb = compressed_to_rgb(msg, MAX_PIXELS)
    except ImageConversionError as e:
        assert e.reason in REASONS and str(e)
        return
    assert rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8
    assert rgb.shape[0] * rgb.shape[1] <= MAX_PIXELS


def test_compressed_size_bombs_are_refused_before_decoding():
    with pytest.raises(ImageConversionError) as e:
        compressed_to_rgb(SimpleNamespace(format="png", data=_png(60_000, 60_000, b"\0" * 32)),
                          MAX_PIXELS)
    assert e.value.reason == "too_large"


# -- parameters, YAML, SetTasks ----------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 12), st.floats(),
                    st.text(max_size=12), st.just("x" * 5000))
TASK_VALUES = {"skill": st.one_of(st.sampled_from(["detect", "point", "query", "caption"]), scalars),
               "object": st.one_of(st.just("person"), scalars),
               "question": st.one_of(st.just("what is here?"), st.just("q" * 2000), scalars),
               "caption_length": st.one_of(st.sampled_from(["short", "normal", "long"]), scalars),
               "every_n": scalars, "hz": scalars, "deadline_ms": scalars,
               "on_miss": st.one_of(st.sampled_from(["cancel", "finish"]), scalars),
               "max_objects": scalars, "max_tokens": scalars, "bogus": scalars}
task_dicts = st.dictionaries(st.sampled_from(sorted(TASK_VALUES)), scalars, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({k: TASK_VALUES[k] for k in d}))
NODE_VALUES = {"model": scalars, "device": scalars, "engine": scalars, "max_batch": scalars,
               "default_deadline_ms": scalars, "default_max_objects": scalars,
               "default_max_tokens": scalars, "max_question_chars": scalars, "max_pixels": scalars,
               "default_on_miss": scalars, "annotate": scalars, "camera_topic": scalars}


@settings(max_examples=400, deadline=None)
@given(node=st.dictionaries(st.sampled_from(sorted(NODE_VALUES)), scalars, max_size=4),
       cams=st.one_of(st.just(["front"]), st.lists(st.one_of(st.text(max_size=6), scalars), max_size=3),
                      scalars),
       topic=st.one_of(st.just("/cam/image"), scalars),
       ctype=st.one_of(st.sampled_from(["image", "compressed"]), scalars),
       tasks=st.one_of(st.just(["t1"]), st.lists(st.text(max_size=5), max_size=3), scalars),
       t1=st.one_of(task_dicts, scalars))
def test_any_parameters_give_a_config_or_config_error(node, cams, topic, ctype, tasks, t1):
    params = {**node, "cameras": cams, "front": {"topic": topic, "type": ctype, "tasks": tasks,
                                                 "t1": t1}}
    try:
        cfg = config_from_params(params)
    except ConfigError as e:
        assert str(e) and len(str(e)) < 2000
        return
    assert isinstance(cfg, PerceptionConfig)
    for cam in cfg.cameras:
        for t in cam.tasks:
            t.to_task().validate(cfg.max_question_chars)     # what passed is runnable


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(st.tuples(st.one_of(st.just("ok"), st.text(max_size=70)), task_dicts),
                      max_size=4))
def test_set_tasks_requests(specs):
    """SetTasks: TaskSpec messages with any field values -> tasks (all) or ConfigError."""
    from photon_ros.task_config import TASK_KEYS

    defaults = PerceptionConfig()
    msgs = []
    for name, d in specs:
        fields = {k: d.get(k, {"every_n": 0, "hz": 0.0, "deadline_ms": 0.0, "max_objects": 0,
                              "max_tokens": 0}.get(k, "")) for k in TASK_KEYS}
        msgs.append(SimpleNamespace(name=name, **fields))
    try:
        out = tasks_from_specs(msgs, defaults, "front")
    except ConfigError as e:
        assert str(e)
        return
    assert len(out) == len(msgs)
    for t in out:
        t.to_task().validate(defaults.max_question_chars)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=200), st.sampled_from([
    "/**: {ros__parameters: {cameras: [front]}}", "- a\n- b", "a: [", "\t\x00", "/**: 5",
    "/**:\n  ros__parameters:\n    cameras: front\n    front: {topic: /x, tasks: [a], a: {skill: detect}}",
    "!!python/object/apply:os.system ['echo hi']", "&a [*a]"])))
def test_any_yaml_file_gives_a_config_or_config_error(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    try:
        load_config(p)
    except ConfigError as e:
        assert str(e)


def test_limits_come_from_photon_core():
    from photon_core import task as T
    from photon_ros.task_config import NODE_DEFAULTS

    assert NODE_DEFAULTS["default_max_objects"] == T.DEFAULT_MAX_OBJECTS
    assert NODE_DEFAULTS["default_max_tokens"] == T.DEFAULT_MAX_TOKENS
    assert NODE_DEFAULTS["max_question_chars"] == T.MAX_QUESTION_CHARS
    d = PerceptionConfig()
    with pytest.raises(ConfigError, match="max_objects"):
        make_task("t", {"skill": "detect", "object": "x", "max_objects": T.MAX_OBJECTS_LIMIT + 1}, d)
    with pytest.raises(ConfigError, match="max_tokens"):
        make_task("t", {"skill": "caption", "max_tokens": T.MAX_TOKENS_LIMIT + 1}, d)
    with pytest.raises(ConfigError, match="max_question_chars"):
        config_from_params({"max_question_chars": T.MAX_QUESTION_CHARS + 1})


# -- bags ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_mcap(tmp_path_factory):
    from photon_ros.sample_bag import make_sample_bag

    out = tmp_path_factory.mktemp("fuzzbag") / "bag"
    make_sample_bag(out, seconds=1.0, fps=4.0, width=64, height=48)
    return next(out.glob("*.mcap"))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1), flips=st.lists(st.tuples(st.integers(0, 10 ** 7), st.integers(0, 255)),
                                           max_size=6), with_metadata=st.booleans())
def test_damaged_bags_read_or_bag_error(tmp_path_factory, sample_mcap, cut, flips, with_metadata):
    """Truncated / bit-flipped mcap files, with and without metadata.yaml: messages (decodable
    images) or BagError -- never another exception."""
    import shutil

    from photon_ros.bag_io import BagError, BagReader

    d = tmp_path_factory.mktemp("dmg")
    raw = bytearray(sample_mcap.read_bytes())
    raw = raw[: int(len(raw) * cut)] if cut < 1 else raw
    for pos, val in flips:
        if raw:
            raw[pos % len(raw)] = val
    (d / sample_mcap.name).write_bytes(bytes(raw))
    if with_metadata:
        shutil.copy(sample_mcap.parent / "metadata.yaml", d / "metadata.yaml")
    try:
        with BagReader(d) as r:
            for m in r.messages():
                assert m.topic
    except BagError as e:
        assert str(e)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("content", [b"", b"\x89MCAP0\r\n", b"SQLite format 3\x00" + b"\0" * 100,
                                     b"random" * 1000])
def test_garbage_bag_files(tmp_path, content):
    from photon_ros.bag_io import BagError, BagReader

    for name in ("x.mcap", "x.db3"):
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(BagError):
            with BagReader(p) as r:
                list(r.messages())
