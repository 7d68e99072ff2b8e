"""Compare two result bags (BASE = reference, NEW = candidate) frame by frame and task by task.

Results are keyed by (camera, task name, source image stamp). Per key:
  - detections: boxes matched greedily by IoU (>= --iou),
  - points: matched greedily by pixel distance (<= --point-px),
  - answers/captions: exact match, plus a similarity ratio (difflib, 0..1).
Per task, precision = matched NEW items / NEW items, recall = matched / BASE items (over the
frames both bags have). Missing frames: keys in BASE that NEW lacks; extra: the reverse.
Latency: Timing.latency_ms and engine_ms percentiles of each bag.

`photon diff` prints the summary, writes a report folder (report.md, summary.json,
latency_hist.png, detections_over_time.png) and exits 1 when a threshold is crossed
(0 = pass, 2 = unreadable input). Needs rosbags (+ matplotlib for the plots), not rclpy.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .bag_io import RESULT_TYPES, BagError, BagReader, decode, stamp_ns

SUMMARY_SIDECAR = "replay_summary.json"   # written by `photon replay` into the bag folder


@dataclass
class Result:
    camera: str
    task: str
    skill: str
    stamp_ns: int
    log_time_ns: int
    kind: str                      # boxes | points | text
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))   # x1 y1 x2 y2 px
    points: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # x y px
    text: str = ""
    latency_ms: float = math.nan
    engine_ms: float = math.nan
    model_id: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.camera, self.task, self.stamp_ns)

    @property
    def count(self) -> int:
        return len(self.boxes) if self.kind == "boxes" else \
            len(self.points) if self.kind == "points" else int(bool(self.text))


def to_result(msgtype: str, m: Any, log_time_ns: int) -> Result:
    t = m.timing
    # Offline replay writes all-zero timing (byte-for-byte reproducible bags): that is "not
    # recorded" (NaN, shown as "-"), not a 0 ms latency that would mask a regression.
    recorded = any((t.engine_ms, t.queue_ms, t.latency_ms))
    nan = math.nan
    base = dict(camera=m.camera, task=m.task.name, skill=m.task.skill, stamp_ns=stamp_ns(m.header),
                log_time_ns=log_time_ns, latency_ms=float(t.latency_ms) if recorded else nan,
                engine_ms=float(t.engine_ms) if recorded else nan, model_id=m.model_id)
    if msgtype.endswith("/DetectionArray"):
        b = np.array([[d.bbox.center_x - d.bbox.size_x / 2, d.bbox.center_y - d.bbox.size_y / 2,
                       d.bbox.center_x + d.bbox.size_x / 2, d.bbox.center_y + d.bbox.size_y / 2]
                      for d in m.detections], float).reshape(-1, 4)
        return Result(kind="boxes", boxes=b, **base)
    if msgtype.endswith("/PointArray"):
        p = np.array([[q.x, q.y] for q in m.points], float).reshape(-1, 2)
        return Result(kind="points", points=p, **base)
    return Result(kind="text", text=m.text, **base)


def load_results(path) -> tuple[dict[tuple, Result], dict]:
    """{key: Result} of a result bag, and info (topics, counts, duplicates, sidecar)."""
    out: dict[tuple, Result] = {}
    info: dict[str, Any] = {"bag": str(path), "duplicates": 0, "messages": 0}
    with BagReader(path) as r:
        topics = [t for t, ty in r.topics.items() if ty in RESULT_TYPES]
        if not topics:
            raise BagError(f"bag {str(path)!r} has no photon_ros result topics "
                           f"(found: {', '.join(f'{t} [{ty}]' for t, ty in r.topics.items()) or 'none'})")
        info["topics"] = sorted(topics)
        for bm in r.messages(topics):
            res = to_result(bm.msgtype, decode(bm.raw, bm.msgtype), bm.log_time_ns)
            info["messages"] += 1
            if res.key in out:
                info["duplicates"] += 1
            out[res.key] = res
    side = Path(path) / SUMMARY_SIDECAR
    if side.is_file():
        try:
            info["replay"] = json.loads(side.read_text())
        except ValueError:
            info["replay"] = {"error": f"unreadable {SUMMARY_SIDECAR}"}
    return out, info


# -- matching --------------------------------------------------------------------------
def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = lambda z: np.clip(z[:, 2] - z[:, 0], 0, None) * np.clip(z[:, 3] - z[:, 1], 0, None)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
    same = np.all(np.isclose(a[:, None, :], b[None, :, :]), axis=-1)   # degenerate equal boxes
    return np.where(same, 1.0, iou)


def greedy_match(score: np.ndarray, ok) -> int:
    """Number of one-to-one pairs, best score first, while ok(score)."""
    if score.size == 0:
        return 0
    pairs = sorted(((float(score[i, j]), i, j) for i in range(score.shape[0])
                    for j in range(score.shape[1])), key=lambda x: -x[0])
    used_i, used_j, n = set(), set(), 0
    for s, i, j in pairs:
        if not ok(s) or i in used_i or j in used_j:
            continue
        used_i.add(i)
        used_j.add(j)
        n += 1
    return n


def match_boxes(base: np.ndarray, new: np.ndarray, iou: float) -> int:
    m = iou_matrix(base, new)
    return greedy_match(m, lambda s: s >= iou)


def match_points(base: np.ndarray, new: np.ndarray, px: float) -> int:
    if len(base) == 0 or len(new) == 0:
        return 0
    d = np.linalg.norm(base[:, None, :] - new[None, :, :], axis=-1)
    # greedy on negated distance: closest first
    return greedy_match(-d, lambda s: -s <= px)


def similarity(a: str, b: str) -> float:
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def percentile(xs, q) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else math.nan


# -- comparing -------------------------------------------------------------------------
@dataclass
class Thresholds:
    iou: float = 0.5
    point_px: float = 10.0
    min_precision: float = 0.95
    min_recall: float = 0.95
    min_answer_similarity: float = 0.9
    max_missing: float = 0.0            # fraction of BASE frames NEW may lack
    max_latency_increase: float | None = None   # relative p50 increase allowed (0.2 = +20%)


def compare(base: dict, new: dict, th: Thresholds) -> dict:
    """Per-task statistics and the list of threshold failures."""
    tasks = sorted({(k[0], k[1]) for k in base} | {(k[0], k[1]) for k in new})
    per_task = {}
    failures: list[str] = []
    for cam, task in tasks:
        bk = {k for k in base if k[:2] == (cam, task)}
        nk = {k for k in new if k[:2] == (cam, task)}
        common = sorted(bk & nk)
        anyr = (base.get(common[0]) if common else None) or \
            next((base[k] for k in bk), None) or next(new[k] for k in nk)
        st: dict[str, Any] = {
            "camera": cam, "task": task, "skill": anyr.skill, "kind": anyr.kind,
            "frames_base": len(bk), "frames_new": len(nk), "frames_common": len(common),
            "missing_frames": len(bk - nk), "extra_frames": len(nk - bk),
            "latency_ms_base": {"p50": percentile([base[k].latency_ms for k in bk], 50),
                                "p99": percentile([base[k].latency_ms for k in bk], 99)},
            "latency_ms_new": {"p50": percentile([new[k].latency_ms for k in nk], 50),
                               "p99": percentile([new[k].latency_ms for k in nk], 99)},
            "engine_ms_base_p50": percentile([base[k].engine_ms for k in bk], 50),
            "engine_ms_new_p50": percentile([new[k].engine_ms for k in nk], 50),
        }
        if anyr.kind in ("boxes", "points"):
            nb = nn = tp = 0
            for k in common:
                b, n = base[k], new[k]
                if anyr.kind == "boxes":
                    tp += match_boxes(b.boxes, n.boxes, th.iou)
                else:
                    tp += match_points(b.points, n.points, th.point_px)
                nb += b.count
                nn += n.count
            st.update(items_base=nb, items_new=nn, matched=tp,
                      precision=(tp / nn) if nn else (1.0 if nb == 0 else 0.0),
                      recall=(tp / nb) if nb else 1.0)
        else:
            sims = [similarity(base[k].text, new[k].text) for k in common]
            exact = sum(base[k].text == new[k].text for k in common)
            st.update(exact=exact, exact_rate=(exact / len(common)) if common else 1.0,
                      similarity=float(np.mean(sims)) if sims else 1.0)
        name = f"{cam}/{task}"
        if st["frames_base"]:
            frac = st["missing_frames"] / st["frames_base"]
            st["missing_fraction"] = frac
            if frac > th.max_missing:
                failures.append(f"{name}: {st['missing_frames']} of {st['frames_base']} BASE frames "
                                f"missing in NEW ({frac:.1%} > {th.max_missing:.1%})")
        if "precision" in st:
            if st["precision"] < th.min_precision:
                failures.append(f"{name}: precision {st['precision']:.3f} < {th.min_precision}")
            if st["recall"] < th.min_recall:
                failures.append(f"{name}: recall {st['recall']:.3f} < {th.min_recall}")
        elif st["similarity"] < th.min_answer_similarity:
            failures.append(f"{name}: answer similarity {st['similarity']:.3f} < "
                            f"{th.min_answer_similarity}")
        lb, ln = st["latency_ms_base"]["p50"], st["latency_ms_new"]["p50"]
        if th.max_latency_increase is not None and lb > 0 and not math.isnan(ln) and \
                ln > lb * (1 + th.max_latency_increase):
            failures.append(f"{name}: latency p50 {ln:.1f} ms vs {lb:.1f} ms "
                            f"(+{ln / lb - 1:.0%} > +{th.max_latency_increase:.0%})")
        per_task[name] = st
    all_lat = lambda d: [r.latency_ms for r in d.values()]  # noqa: E731
    overall = {
        "results_base": len(base), "results_new": len(new),
        "latency_ms_base": {"p50": percentile(all_lat(base), 50), "p99": percentile(all_lat(base), 99)},
        "latency_ms_new": {"p50": percentile(all_lat(new), 50), "p99": percentile(all_lat(new), 99)},
    }
    return {"tasks": per_task, "overall": overall, "failures": failures,
            "passed": not failures, "thresholds": th.__dict__}


# -- report ----------------------------------------------------------------------------
def _fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def summary_lines(cmp: dict, base_info: dict, new_info: dict) -> list[str]:
    o = cmp["overall"]
    lines = [f"BASE {base_info['bag']}: {o['results_base']} results",
             f"NEW  {new_info['bag']}: {o['results_new']} results",
             f"latency p50/p99 ms: BASE {_fmt(o['latency_ms_base']['p50'])}/"
             f"{_fmt(o['latency_ms_base']['p99'])}  NEW {_fmt(o['latency_ms_new']['p50'])}/"
             f"{_fmt(o['latency_ms_new']['p99'])}"]
    for name, st in cmp["tasks"].items():
        s = (f"  {name} [{st['skill']}]: frames {st['frames_common']}/{st['frames_base']} "
             f"(missing {st['missing_frames']}, extra {st['extra_frames']})")
        if "precision" in st:
            s += (f", precision {st['precision']:.3f} recall {st['recall']:.3f} "
                  f"({st['matched']} matched of {st['items_base']} BASE / {st['items_new']} NEW)")
        else:
            s += f", exact {st['exact']}/{st['frames_common']}, similarity {st['similarity']:.3f}"
        s += (f", latency p50 {_fmt(st['latency_ms_base']['p50'])} -> "
              f"{_fmt(st['latency_ms_new']['p50'])} ms")
        lines.append(s)
    for info, tag in ((base_info, "BASE"), (new_info, "NEW")):
        rep = info.get("replay") or {}
        if rep.get("dropped"):
            lines.append(f"{tag} replay ({rep.get('mode')}): dropped {rep['dropped']}")
        if info.get("duplicates"):
            lines.append(f"{tag}: {info['duplicates']} duplicate results (same frame and task)")
    lines.append("PASS" if cmp["passed"] else "FAIL: " + "; ".join(cmp["failures"]))
    return lines


def write_report(out_dir, cmp: dict, base: dict, new: dict, base_info: dict, new_info: dict,
                 lines: list[str]) -> dict[str, str]:
    """report.md, summary.json and the two PNG plots; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": str(out / "report.md"), "json": str(out / "summary.json")}
    same = Path(base_info["bag"]).resolve() == Path(new_info["bag"]).resolve()
    plots = _plots(out, base, {} if same else new)
    files.update(plots)
    md = ["# photon diff report", "", f"- BASE: `{base_info['bag']}`", f"- NEW: `{new_info['bag']}`",
          f"- result: **{'PASS' if cmp['passed'] else 'FAIL'}**", ""]
    if cmp["failures"]:
        md += ["## Failures", ""] + [f"- {f}" for f in cmp["failures"]] + [""]
    md += ["## Per task", "",
           "| task | skill | frames (common/base/new) | missing | precision | recall | exact | "
           "similarity | latency p50 base→new (ms) | p99 base→new (ms) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, st in cmp["tasks"].items():
        md.append(f"| {name} | {st['skill']} | {st['frames_common']}/{st['frames_base']}/"
                  f"{st['frames_new']} | {st['missing_frames']} | {_fmt(st.get('precision'), 3)} | "
                  f"{_fmt(st.get('recall'), 3)} | {_fmt(st.get('exact'))} | "
                  f"{_fmt(st.get('similarity'), 3)} | {_fmt(st['latency_ms_base']['p50'])}→"
                  f"{_fmt(st['latency_ms_new']['p50'])} | {_fmt(st['latency_ms_base']['p99'])}→"
                  f"{_fmt(st['latency_ms_new']['p99'])} |")
    for info, tag in ((base_info, "BASE"), (new_info, "NEW")):
        if info.get("replay"):
            md += ["", f"## {tag} replay", "", "```json", json.dumps(info["replay"], indent=1), "```"]
    md += ["", "## Plots", ""]
    for k, p in plots.items():
        md.append(f"![{k}]({Path(p).name})")
    md += ["", "## Summary", "", "```", *lines, "```", ""]
    Path(files["markdown"]).write_text("\n".join(md))
    Path(files["json"]).write_text(json.dumps({**cmp, "base": base_info, "new": new_info},
                                              indent=1, default=str))
    return files


def _plots(out: Path, base: dict, new: dict, labels=("BASE", "NEW")) -> dict[str, str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    files = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    lat = [[r.latency_ms for r in d.values() if not math.isnan(r.latency_ms)] for d in (base, new)]
    hi = max([max(x) for x in lat if x] + [1.0])
    bins = np.linspace(0, hi * 1.05, 40)
    for xs, label in zip(lat, labels):
        if xs:
            ax.hist(xs, bins=bins, alpha=0.55, label=f"{label} (n={len(xs)})")
    ax.set_xlabel("latency_ms (source stamp to result)")
    ax.set_ylabel("results")
    ax.set_title("Latency")
    ax.legend()
    fig.tight_layout()
    files["latency_hist"] = str(out / "latency_hist.png")
    fig.savefig(files["latency_hist"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    t0 = min([r.stamp_ns for d in (base, new) for r in d.values()] or [0])
    for d, label, style in ((base, labels[0], "-"), (new, labels[1], "--")):
        series = defaultdict(list)
        for r in d.values():
            if r.kind in ("boxes", "points"):
                series[f"{r.camera}/{r.task}"].append(((r.stamp_ns - t0) / 1e9, r.count))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".",
                    label=f"{label} {name}")
    ax.set_xlabel("source stamp (s from first frame)")
    ax.set_ylabel("detections / points per frame")
    ax.set_title("Detections per frame over time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    files["detections_over_time"] = str(out / "detections_over_time.png")
    fig.savefig(files["detections_over_time"], dpi=90)
    plt.close(fig)
    return files


def run_diff(base_bag, new_bag, th: Thresholds | None = None, report_dir=None,
             out: Any = "stdout") -> dict:
    """Compare, print the summary to `out` ("stdout", a file, or None for silence), write
    the report when report_dir is given; returns the comparison dict."""
    th = th or Thresholds()
    base, base_info = load_results(base_bag)
    new, new_info = load_results(new_bag)
    cmp = compare(base, new, th)
    lines = summary_lines(cmp, base_info, new_info)
    if report_dir is not None:
        cmp["report"] = write_report(report_dir, cmp, base, new, base_info, new_info, lines)
        lines.append(f"report: {cmp['report']['markdown']}")
    if out is not None:
        print("\n".join(lines), file=sys.stdout if out == "stdout" else out)
    return cmp


# -- command line ----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", help="reference result bag")
    p.add_argument("new", help="candidate result bag")
    p.add_argument("--iou", type=float, default=0.5, help="box match IoU")
    p.add_argument("--point-px", type=float, default=10.0, help="point match distance, pixels")
    p.add_argument("--min-precision", type=float, default=0.95,
                   help="fail when a task's precision (NEW vs BASE) is below this")
    p.add_argument("--min-recall", type=float, default=0.95,
                   help="fail when a task's recall (NEW vs BASE) is below this")
    p.add_argument("--min-answer-similarity", type=float, default=0.9,
                   help="fail when query/caption text similarity (0..1) is below this")
    p.add_argument("--max-missing", type=float, default=0.0,
                   help="fraction of BASE frames NEW may lack per task (default 0)")
    p.add_argument("--max-latency-increase", type=float, default=None,
                   help="fail when a task's latency p50 grows by more than this fraction "
                        "(e.g. 0.2); not checked by default")
    p.add_argument("--report", default=None,
                   help="report folder (default: NEW_BAG.diff next to the NEW bag)")
    p.add_argument("--no-report", action="store_true", help="write no report folder")


def main(args) -> int:
    th = Thresholds(iou=args.iou, point_px=args.point_px, min_precision=args.min_precision,
                    min_recall=args.min_recall, min_answer_similarity=args.min_answer_similarity,
                    max_missing=args.max_missing, max_latency_increase=args.max_latency_increase)
    report = None if args.no_report else (args.report or f"{str(args.new).rstrip('/')}.diff")
    cmp = run_diff(args.base, args.new, th, report)
    return 0 if cmp["passed"] else 1
