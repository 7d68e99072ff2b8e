"""`photon diff`: identical bags pass, injected regressions fail with the reason, reports."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from builtin_interfaces.msg import Time
from std_msgs.msg import Header

from photon_core.cli import main as photon
from photon_ros.bag_io import BagError, BagWriter
from photon_ros.diff import (Thresholds, compare, iou_matrix, load_results, match_boxes,
                             match_points, run_diff, similarity)
from photon_ros.msg import (Answer, BoundingBox2D, Detection, DetectionArray, ImagePoint,
                            NormalizedBox, PointArray, TaskInfo, Timing)

T0 = 1_700_000_000


def _header(i):
    return Header(stamp=Time(sec=T0 + i // 10, nanosec=(i % 10) * 100_000_000), frame_id="cam")


def _det(i, boxes, latency=20.0):
    dets = [Detection(label="person", score=math.nan,
                      bbox=BoundingBox2D(center_x=(x0 + x1) / 2, center_y=(y0 + y1) / 2,
                                         size_x=x1 - x0, size_y=y1 - y0),
                      box=NormalizedBox(x_min=x0 / 640, y_min=y0 / 480, x_max=x1 / 640, y_max=y1 / 480))
            for x0, y0, x1, y1 in boxes]
    return DetectionArray(header=_header(i), camera="front", model_id="m",
                          task=TaskInfo(name="people", skill="detect", target="person"),
                          image_width=640, image_height=480, detections=dets,
                          timing=Timing(engine_ms=latency * 0.8, queue_ms=0.0, latency_ms=latency))


def _pts(i, pts, latency=20.0):
    return PointArray(header=_header(i), camera="front", model_id="m",
                      task=TaskInfo(name="hands", skill="point", target="hand"),
                      image_width=640, image_height=480,
                      points=[ImagePoint(label="hand", x=x, y=y, x_norm=x / 640, y_norm=y / 480)
                              for x, y in pts],
                      timing=Timing(engine_ms=latency, queue_ms=0.0, latency_ms=latency))


def _ans(i, text, latency=50.0):
    return Answer(header=_header(i), camera="front", model_id="m",
                  task=TaskInfo(name="scene", skill="caption", target="short"), text=text,
                  finish_reason="stop", tokens=5,
                  timing=Timing(engine_ms=latency, queue_ms=0.0, latency_ms=latency))


def _frames(n=20):
    out = []
    for i in range(n):
        x = 10.0 * i
        out.append(("/front/detections", _det(i, [(x, 100, x + 80, 300), (400, 50, 460, 120)])))
        if i % 2 == 0:
            out.append(("/front/points", _pts(i, [(x + 40, 200.0)])))
        if i % 5 == 0:
            out.append(("/front/answer", _ans(i, f"a red car on a street, frame {i // 5}")))
    return out


def _write(path, msgs):
    with BagWriter(path) as w:
        for k, (topic, m) in enumerate(msgs):
            w.write(topic, m, T0 * 10**9 + k * 1000)
    return path


@pytest.fixture()
def base(tmp_path):
    return _write(tmp_path / "base", _frames())


def _args(base, new, *extra):
    return ["diff", str(base), str(new), *extra]


def test_matching_primitives():
    a = np.array([[0, 0, 10, 10], [20, 20, 30, 30.]])
    b = np.array([[1, 1, 11, 11], [100, 100, 110, 110.]])
    assert iou_matrix(a, b)[0, 0] == pytest.approx(81 / 119)
    assert match_boxes(a, b, 0.5) == 1 and match_boxes(a, a, 0.5) == 2
    assert match_boxes(a, b, 0.7) == 0
    # one-to-one: two NEW boxes on one BASE box match once
    assert match_boxes(a[:1], np.array([[0, 0, 10, 10], [0, 0, 10, 10.]]), 0.5) == 1
    assert match_points(np.array([[0, 0], [5, 5.]]), np.array([[4, 4], [50, 5.]]), 10) == 1
    assert match_points(np.zeros((0, 2)), np.array([[1, 1.]]), 10) == 0
    assert similarity("abc", "abc") == 1.0 and 0 < similarity("abcd", "abce") < 1


def test_identical_bags_pass(base, tmp_path, capsys):
    same = _write(tmp_path / "same", _frames())
    rc = photon(_args(base, same, "--report", str(tmp_path / "rep")))
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out
    assert "front/people [detect]: frames 20/20 (missing 0, extra 0), precision 1.000 recall 1.000" in out
    assert "front/scene [caption]: frames 4/4" in out and "similarity 1.000" in out
    for f in ("report.md", "summary.json", "latency_hist.png", "detections_over_time.png"):
        assert (tmp_path / "rep" / f).stat().st_size > 100
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert s["passed"] and s["tasks"]["front/hands"]["recall"] == 1.0
    # a bag against itself too (what the demo does)
    assert photon(_args(base, base, "--no-report")) == 0


def test_detects_injected_box_regression(base, tmp_path, capsys):
    msgs = _frames()
    for topic, m in msgs:
        if topic == "/front/detections" and m.header.stamp.nanosec // 100_000_000 % 2 == 0:
            m.detections = m.detections[:1]                 # half the frames lose a box
            b = m.detections[0].bbox
            b.center_x += b.size_x * 0.8                    # ... and the other one moves
    new = _write(tmp_path / "new", msgs)
    rc = photon(_args(base, new, "--report", str(tmp_path / "rep")))
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out
    assert "front/people: precision" in out and "front/people: recall" in out
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())
    people = s["tasks"]["front/people"]
    assert people["items_base"] == 40 and people["items_new"] == 30
    assert people["matched"] == 20 and people["recall"] == pytest.approx(0.5)
    assert s["tasks"]["front/hands"]["recall"] == 1.0          # untouched tasks still pass
    assert "FAIL" in (tmp_path / "rep" / "report.md").read_text()
    # a looser IoU does not rescue a moved box, a lower threshold does
    assert photon(_args(base, new, "--no-report", "--min-precision", "0.6",
                        "--min-recall", "0.5")) == 0


def test_detects_missing_frames_points_and_answers(base, tmp_path, capsys):
    msgs = [(t, copy.deepcopy(m)) for t, m in _frames()]
    msgs = [(t, m) for t, m in msgs
            if not (t == "/front/detections" and m.header.stamp.sec == T0 + 1
                    and m.header.stamp.nanosec >= 500_000_000)]   # 5 frames missing
    for t, m in msgs:
        if t == "/front/points":
            m.points[0].x += 15.0                                 # beyond --point-px 10
        if t == "/front/answer" and m.header.stamp.sec == T0:
            m.text = "something else entirely"
    new = _write(tmp_path / "new", msgs)
    cmp = run_diff(base, new, Thresholds(), out=None)
    f = " | ".join(cmp["failures"])
    assert "front/people: 5 of 20 BASE frames missing in NEW" in f
    assert "front/hands: precision 0.000" in f and "front/hands: recall 0.000" in f
    assert "front/scene: answer similarity" in f
    assert cmp["tasks"]["front/people"]["missing_frames"] == 5
    assert cmp["tasks"]["front/scene"]["exact"] == 2
    # within tolerance: points pass at --point-px 20, missing frames at --max-missing 0.3
    th = Thresholds(point_px=20.0, max_missing=0.3, min_answer_similarity=0.0)
    assert run_diff(base, new, th, out=None)["passed"]


def test_latency_regression_is_opt_in(base, tmp_path):
    msgs = _frames()
    for _, m in msgs:
        m.timing.latency_ms *= 2
    new = _write(tmp_path / "slow", msgs)
    cmp = run_diff(base, new, Thresholds(), out=None)
    assert cmp["passed"]
    assert cmp["overall"]["latency_ms_new"]["p50"] == pytest.approx(2 * cmp["overall"]["latency_ms_base"]["p50"])
    cmp = run_diff(base, new, Thresholds(max_latency_increase=0.2), out=None)
    assert not cmp["passed"] and "latency p50 40.0 ms vs 20.0 ms" in " ".join(cmp["failures"])


def test_zeroed_timing_reads_as_not_recorded(base, tmp_path):
    # Offline replay zeroes timing by default: diff must not read that as a 0 ms latency.
    msgs = _frames()
    for _, m in msgs:
        m.timing = Timing()
    zeroed = _write(tmp_path / "zeroed", msgs)
    cmp = run_diff(base, zeroed, Thresholds(max_latency_increase=0.2), out=None)
    assert cmp["passed"]
    assert math.isnan(cmp["overall"]["latency_ms_new"]["p50"])
    assert cmp["overall"]["latency_ms_base"]["p50"] == pytest.approx(20.0)


def test_unreadable_inputs(tmp_path, capsys, base):
    assert photon(_args(tmp_path / "nope", base)) == 2
    assert "does not exist" in capsys.readouterr().err
    from photon_ros.sample_bag import make_sample_bag

    make_sample_bag(tmp_path / "cams", seconds=0.2, fps=5, width=64, height=48)
    with pytest.raises(BagError, match="no photon_ros result topics.*sensor_msgs/msg/Image"):
        load_results(tmp_path / "cams")


def test_compare_counts_extra_frames(base, tmp_path):
    new = _write(tmp_path / "more", _frames(25))
    cmp = compare(load_results(base)[0], load_results(new)[0], Thresholds())
    assert cmp["passed"] and cmp["tasks"]["front/people"]["extra_frames"] == 5
