"""Grounding-JSON parser: property tests over valid, truncated and malformed answers."""
from __future__ import annotations

import json

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from photon_core.models.grounding_json import parse_grounding

coord = st.integers(0, 1000)
box = st.tuples(coord, coord, coord, coord)
label = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)


def _answer(boxes, labels, fence):
    body = json.dumps([{"bbox_2d": list(b), "label": l} for b, l in zip(boxes, labels)])
    return f"```json\n{body}\n```" if fence else body


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(box, label), max_size=6), st.booleans())
def test_valid_answers_parse_exactly(items, fence):
    boxes = [b for b, _ in items]
    res = parse_grounding(_answer(boxes, [l for _, l in items], fence), "detect")
    assert res.error is None and res.skipped == 0
    assert len(res.objects) == len(boxes)
    for o, (x0, y0, x1, y1) in zip(res.objects, boxes):
        assert o == {"x_min": min(x0, x1) / 1000, "y_min": min(y0, y1) / 1000,
                     "x_max": max(x0, x1) / 1000, "y_max": max(y0, y1) / 1000}
    pts = parse_grounding(_answer(boxes, [l for _, l in items], fence), "point")
    assert [v for p in pts.objects for v in (p["x"], p["y"])] == pytest.approx(
        [v for b in boxes for v in ((b[0] + b[2]) / 2000, (b[1] + b[3]) / 2000)], abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(box, min_size=1, max_size=5), st.data())
def test_truncated_answers_never_raise_and_salvage_a_prefix(boxes, data):
    text = _answer(boxes, ["cup"] * len(boxes), False)
    cut = data.draw(st.integers(0, len(text) - 1))
    strict = parse_grounding(text[:cut], "detect")
    assert strict.objects == [] and strict.error          # malformed: empty + error
    salv = parse_grounding(text[:cut], "detect", salvage=True)
    full = parse_grounding(text, "detect").objects
    assert salv.objects == full[:len(salv.objects)]       # only complete boxes, in order
    assert salv.error


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=200),
    st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=5),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(
                     st.sampled_from(["bbox_2d", "point_2d", "label", "objects", "x"]), c, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v, allow_nan=True))),
    st.sampled_from(["detect", "point"]), st.booleans())
def test_anything_gives_valid_normalized_output(text, skill, salvage):
    res = parse_grounding(text, skill, max_objects=3, salvage=salvage)
    assert len(res.objects) <= 3
    for o in res.objects:
        assert all(0.0 <= v <= 1.0 for v in o.values())
        if skill == "detect":
            assert set(o) == {"x_min", "y_min", "x_max", "y_max"}
            assert o["x_min"] <= o["x_max"] and o["y_min"] <= o["y_max"]
        else:
            assert set(o) == {"x", "y"}


def test_out_of_range_and_bad_entries():
    res = parse_grounding('[{"bbox_2d": [-50, 20, 1500, 400]}, {"bbox_2d": [1, 2, 3]}, '
                          '{"bbox_2d": ["a", 1, 2, 3]}, {"point_2d": [1, 2]}, 5]', "detect")
    assert res.objects == [{"x_min": 0.0, "y_min": 0.02, "x_max": 1.0, "y_max": 0.4}]
    assert res.skipped == 4 and res.error is None
    assert parse_grounding('{"point_2d": [500, 250], "label": "cup"}', "point").objects == \
        [{"x": 0.5, "y": 0.25}]
    assert parse_grounding("", "point").error


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(box, label), min_size=1, max_size=5), st.booleans(), st.data())
def test_entry_cap_stops_at_the_max_objects_th_entry(items, fence, data):
    """EntryCap fed the answer in pieces: True from the piece that closes the k-th entry
    (labels with brackets, braces, quotes and backslashes inside their strings), never for
    k above the entry count; the text up to there salvages exactly k objects, no error."""
    from photon_core.models.grounding_json import EntryCap
    text = _answer([b for b, _ in items], [l for _, l in items], fence)
    k = data.draw(st.integers(1, len(items) + 1))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(text)), max_size=30))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if b > a]
    cap, fed, hit, last = EntryCap("detect", k), "", None, ""
    for p in pieces:
        fed += p
        if cap.feed(p):
            hit, last = fed, p
            break
    if k > len(items):
        assert hit is None
        return
    assert hit is not None
    res = parse_grounding(hit, "detect", max_objects=k, salvage=True)
    assert res.error is None and res.objects == parse_grounding(text, "detect").objects[:k]
    # the piece that hit holds the k-th entry's closing brace: without it, fewer entries
    assert len(parse_grounding(hit[:-len(last)], "detect", salvage=True).objects) < k


def test_entry_cap_counts_only_usable_list_entries():
    from photon_core.models.grounding_json import EntryCap
    cap = EntryCap("detect", 1)
    assert not cap.feed('[{"point_2d": [1, 2]}, {"bbox_2d": [1, 2, 3]}, ')   # not boxes
    assert not cap.feed('{"label": "{[\\"}]", ')                # braces in a string
    assert cap.feed('"bbox_2d": [1, 2, 3, 4]}')                 # the first usable box
    assert EntryCap("point", 1).feed('[{"point_2d": [1, 2]}')
    wrapped = EntryCap("detect", 1)                             # a wrapper: never cut
    assert not wrapped.feed('{"objects": [{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [1, 2, 3, 4]}]}')


def test_text_task_ends_where_until_says():
    """The fast path's TextTask: the token until() accepts is emitted and ends the run
    (length), as the reference's step does."""
    from types import SimpleNamespace

    from photon_core.fast.fast_family import TextTask
    from photon_core.task import Task
    seen, ended = [], []
    run = SimpleNamespace(pos=10, capacity=100, steps=0, emit=seen.append, end=ended.append)
    tt = TextTask(Task("detect", object="cup"), stop_ids=(0,), budget=50, sampled=False,
                  until=lambda tok: tok == 7)
    for tok in (5, 6, 7):
        tt.commit(run, 0, [tok, 0, 0, 0])
    assert seen == [5, 6, 7] and ended == ["length"] and run.steps == 3
