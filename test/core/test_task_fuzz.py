"""Fuzzing the task contract (hypothesis): every Task either validates or raises TaskError
with a message, never another exception; the limits are the ones in photon_core.task; every
coordinate an engine returns is inside 0..1."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from photon_core.task import (DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS, MAX_OBJECT_CHARS,
                              MAX_OBJECTS_LIMIT, MAX_QUESTION_CHARS, MAX_TOKENS_LIMIT, SKILLS,
                              Task, TaskError, build_result, clamp_objects)

anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                     st.text(max_size=40), st.binary(max_size=8), st.lists(st.integers(), max_size=2))
ints = st.one_of(st.integers(-10, 2000), st.just(2 ** 70), st.booleans(), st.floats(), st.text(max_size=3))
texts = st.one_of(st.text(max_size=60), st.text(min_size=1000, max_size=1100), anything)


@settings(max_examples=400, deadline=None)
@given(skill=st.one_of(st.sampled_from(SKILLS), anything), obj=texts, question=texts,
       length=st.one_of(st.sampled_from(("short", "normal", "long")), anything),
       max_tokens=ints, max_objects=ints,
       temperature=st.one_of(st.floats(allow_nan=True, allow_infinity=True), anything),
       top_p=st.one_of(st.floats(allow_nan=True, allow_infinity=True), anything),
       seed=st.one_of(st.none(), ints))
def test_any_task_validates_or_says_why(skill, obj, question, length, max_tokens, max_objects,
                                         temperature, top_p, seed):
    t = Task(skill, object=obj, question=question, caption_length=length, max_tokens=max_tokens,
             max_objects=max_objects, temperature=temperature, top_p=top_p, seed=seed)
    try:
        assert t.validate() is t
    except TaskError as e:
        assert str(e)
        return
    # what passed is inside every limit
    assert t.skill in SKILLS
    assert 1 <= t.max_tokens <= MAX_TOKENS_LIMIT and 1 <= t.max_objects <= MAX_OBJECTS_LIMIT
    assert len(t.question) <= MAX_QUESTION_CHARS and len(t.object) <= MAX_OBJECT_CHARS
    assert math.isfinite(t.temperature) and t.temperature >= 0 and 0 < t.top_p <= 1


def test_limits_are_shared():
    """CLI defaults, node defaults and Task defaults are the same numbers (one place)."""
    from photon_core.cli import build_parser

    t = Task("detect", object="x")
    assert (t.max_objects, t.max_tokens) == (DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS)
    p = build_parser()
    det = p.parse_args(["detect", "--model", "m", "--image", "i", "--object", "x"])
    cap = p.parse_args(["caption", "--model", "m", "--image", "i"])
    assert det.max_objects == DEFAULT_MAX_OBJECTS and cap.max_tokens == DEFAULT_MAX_TOKENS
    for bad in (Task("query", question="q" * (MAX_QUESTION_CHARS + 1)),
                Task("detect", object="x", max_objects=MAX_OBJECTS_LIMIT + 1),
                Task("caption", max_tokens=MAX_TOKENS_LIMIT + 1),
                Task("detect", object="x" * (MAX_OBJECT_CHARS + 1))):
        with pytest.raises(TaskError):
            bad.validate()
    # a caller may only lower the question limit, never raise it
    with pytest.raises(TaskError, match=str(MAX_QUESTION_CHARS)):
        Task("query", question="q" * (MAX_QUESTION_CHARS + 1)).validate(10 ** 6)


coord = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.fixed_dictionaries({"x_min": coord, "y_min": coord, "x_max": coord,
                                       "y_max": coord}), max_size=5),
       st.lists(st.fixed_dictionaries({"x": coord, "y": coord}), max_size=5))
def test_results_are_inside_0_1(boxes, points):
    timings = {"encode_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0}
    for skill, objs in (("detect", boxes), ("point", points)):
        res = build_result(Task(skill, object="x"), objs, "", "stop", 3, timings)
        out = res.output["objects" if skill == "detect" else "points"]
        assert len(out) == len(objs)
        for o, src in zip(out, objs):
            assert set(o) == set(src)
            for k, v in o.items():
                assert 0.0 <= v <= 1.0
                if 0.0 <= src[k] <= 1.0:
                    assert v == float(src[k])         # inside: untouched


def test_engine_boxes_on_a_huge_image_stay_inside(fast_model):
    """The issue's case: an 8000x6000 frame gave y_min -0.112. Whatever the random model says,
    what comes out of the engine is inside 0..1."""
    import numpy as np

    img = np.random.default_rng(4).integers(0, 256, (600, 800, 3), dtype=np.uint8)
    img = np.repeat(np.repeat(img, 10, axis=0), 10, axis=1)          # 8000x6000
    enc = fast_model.encode_image(img)
    for skill in ("detect", "point"):
        out = fast_model.run(enc, Task(skill, object="person", max_objects=8)).output
        for o in out["objects" if skill == "detect" else "points"]:
            assert all(0.0 <= v <= 1.0 for v in o.values()), o


def test_clamp_objects_keeps_order_and_keys():
    objs = [{"x_min": -0.2, "y_min": 0.5, "x_max": 1.7, "y_max": float("nan")}, {"x": 0.25, "y": 2}]
    assert clamp_objects(objs) == [{"x_min": 0.0, "y_min": 0.5, "x_max": 1.0, "y_max": 0.0},
                                   {"x": 0.25, "y": 1.0}]
