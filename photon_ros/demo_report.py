"""The demo's report: what the pipeline produced from the sample bag.

report.md with: per result topic, how many messages; per task, results, mean objects per
frame and latency p50/p99 (measured on this machine); what was dropped and why; a few
annotated frames (the bag's image with that frame's boxes, points and answers drawn on it);
the latency histogram and detections-over-time plot. No comparison: a diff needs two
different runs (`photon diff BASE NEW`), and the report says how to make one.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from .bag_io import CAMERA_TYPES, RESULT_TYPES, BagReader, decode, stamp_ns
from .diff import _plots, load_results, percentile

COLORS = [(255, 64, 64), (64, 200, 255), (255, 210, 0), (120, 255, 120), (255, 120, 255)]


def topic_counts(bag) -> dict[str, int]:
    """Messages per result topic of a result bag."""
    counts: Counter = Counter()
    with BagReader(bag) as r:
        topics = [t for t, ty in r.topics.items() if ty in RESULT_TYPES]
        for m in r.messages(topics):
            counts[m.topic] += 1
    return dict(sorted(counts.items()))


def task_table(results: dict) -> list[dict]:
    """Per (camera, task): results, frames with >= 1 object, mean objects, latency."""
    by = defaultdict(list)
    for r in results.values():
        by[(r.camera, r.task, r.skill)].append(r)
    rows = []
    for (cam, task, skill), rs in sorted(by.items()):
        lat = [r.latency_ms for r in rs if not math.isnan(r.latency_ms)]
        counts = [r.count for r in rs]
        rows.append({"camera": cam, "task": task, "skill": skill, "results": len(rs),
                     "with_output": sum(1 for c in counts if c),
                     "mean_items": float(np.mean(counts)) if counts else 0.0,
                     "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99)})
    return rows


def annotate_frames(sample_bag, results: dict, out: Path, n: int = 4) -> list[str]:
    """Draw the results on n evenly spaced frames of the input bag; returns PNG paths."""
    from PIL import Image, ImageDraw

    from .image_conversion import compressed_to_rgb, image_to_rgb

    by_stamp = defaultdict(list)
    for r in results.values():
        by_stamp[r.stamp_ns].append(r)
    stamps = sorted(by_stamp)
    if not stamps:
        return []
    pick = {stamps[int(i)] for i in np.linspace(0, len(stamps) - 1, min(n, len(stamps)))}
    files = []
    with BagReader(sample_bag) as rd:
        cams = [t for t, ty in rd.topics.items() if ty in CAMERA_TYPES]
        for m in rd.messages(cams):
            msg = decode(m.raw, m.msgtype)
            s = stamp_ns(msg.header)
            if s not in pick:
                continue
            pick.discard(s)
            rgb = compressed_to_rgb(msg) if m.msgtype.endswith("CompressedImage") else image_to_rgb(msg)
            img = Image.fromarray(np.ascontiguousarray(rgb))
            draw = ImageDraw.Draw(img)
            lines = []
            for i, r in enumerate(sorted(by_stamp[s], key=lambda r: r.task)):
                c = COLORS[i % len(COLORS)]
                for x0, y0, x1, y1 in r.boxes:
                    draw.rectangle([x0, y0, x1, y1], outline=c, width=2)
                    draw.text((x0 + 2, y0 + 1), r.task, fill=c)
                for x, y in r.points:
                    draw.ellipse([x - 4, y - 4, x + 4, y + 4], outline=c, width=2)
                if r.kind == "text":
                    lines.append((c, f"{r.task}: {r.text[:70]}"))
                else:
                    lines.append((c, f"{r.task}: {r.count} {r.kind}"))
            for j, (c, text) in enumerate(lines):
                draw.text((4, 4 + 12 * j), text, fill=c)
            path = out / f"frame_{len(files):02d}_{s}.png"
            img.save(path)
            files.append(str(path))
            if not pick:
                break
    return files


def write_demo_report(out_dir, results_bag, sample_bag, stats: dict, tiny_note: str | None,
                      params) -> dict:
    """report.md + summary.json + plots + annotated frames; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("frame_*.png"):
        old.unlink()
    results, info = load_results(results_bag)
    counts = topic_counts(results_bag)
    rows = task_table(results)
    plots = _plots(out, results, {}, labels=("results", ""))
    frames = annotate_frames(sample_bag, results, out)
    md = ["# photon demo report", ""]
    if tiny_note:
        md += [f"> **{tiny_note}**", ""]
    md += [f"- input: `{sample_bag}` ({stats.get('frames', 0)} camera frames)",
           f"- parameters: `{params}`", f"- model: `{stats.get('model_id', '')}`",
           f"- result bag: `{results_bag}` ({sum(counts.values())} messages)",
           f"- replay: {stats.get('mode', '')}, {stats.get('wall_s', 0):.1f} s wall", "",
           "## Messages per result topic", "", "| topic | messages |", "|---|---|"]
    md += [f"| `{t}` | {n} |" for t, n in counts.items()]
    md += ["", "## Per task (latency measured on this machine, source stamp to result)", "",
           "| camera | task | skill | results | with output | mean objects | p50 ms | p99 ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['camera']} | {r['task']} | {r['skill']} | {r['results']} | "
                  f"{r['with_output']} | {r['mean_items']:.2f} | {_f(r['latency_p50_ms'])} | "
                  f"{_f(r['latency_p99_ms'])} |")
    drops = stats.get("drops") or {}
    md += ["", "## Frames not answered", ""]
    md += ([f"- {k}: {v}" for k, v in drops.items()] if drops else ["- none"])
    if stats.get("error"):
        md += ["", f"**error:** {stats['error']}"]
    if frames:
        md += ["", "## Annotated frames", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in frames]
    if plots:
        md += ["", "## Plots", ""] + [f"![{k}]({Path(p).name})" for k, p in plots.items()]
    md += ["", "## Compare two runs", "",
           "A comparison needs two different runs, e.g. another model, dtype or engine:", "",
           "```", f"photon replay {sample_bag} --params {params} --out NEW --model ...",
           f"photon diff {results_bag} NEW", "```", ""]
    files = {"markdown": str(out / "report.md"), "json": str(out / "summary.json"),
             **plots, "frames": frames}
    Path(files["markdown"]).write_text("\n".join(md))
    Path(files["json"]).write_text(json.dumps({"topics": counts, "tasks": rows, "replay": stats,
                                               "tiny_model": tiny_note, "frames": frames},
                                              indent=1, default=str))
    return files


def _f(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"
