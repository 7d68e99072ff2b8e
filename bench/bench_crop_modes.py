"""What the cheaper crop modes cost in outputs and save in time: the same frames encoded with
the full overlap crops and with each of --modes (default: the global view only, crops="global",
and a budget of 4 local crops, "overlap:4"; photon_core/encode_request.py), then the same
detect task on each; boxes matched greedily by IoU, the full encode's boxes taken as the
reference.

Reported per mode: encode ms (median), detect boxes, mean IoU of each full box with its best
box in the mode, recall / precision at IoU >= 0.5, frames whose box count agrees.

With random weights (no checkpoint given) the detections are noise and this is only a
plumbing check of the option (it runs end to end, the numbers are not a quality figure);
give a real checkpoint (--model DIR) and real frames (--images DIR) for the measured effect.

Usage:
  PYTHONPATH=. python3 bench/bench_crop_modes.py                      # H200, real shapes, random
  PYTHONPATH=. python3 bench/bench_crop_modes.py --smoke              # CPU, tiny random model
  PYTHONPATH=. python3 bench/bench_crop_modes.py --model DIR --images DIR --object person
Writes $OUT/bench_crop_modes.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.out_dir import write_json  # noqa: E402
from photon_core.encode_request import EncodeRequest  # noqa: E402
from photon_core.task import Task  # noqa: E402


def iou(a: dict, b: dict) -> float:
    ix = max(0.0, min(a["x_max"], b["x_max"]) - max(a["x_min"], b["x_min"]))
    iy = max(0.0, min(a["y_max"], b["y_max"]) - max(a["y_min"], b["y_min"]))
    inter = ix * iy
    area = lambda r: max(0.0, r["x_max"] - r["x_min"]) * max(0.0, r["y_max"] - r["y_min"])  # noqa: E731
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def match(ref: list, got: list, thr: float = 0.5) -> dict:
    """Greedy one-to-one matching by IoU (highest first)."""
    pairs = sorted(((iou(r, g), i, j) for i, r in enumerate(ref) for j, g in enumerate(got)),
                   reverse=True)
    used_r, used_g, matched = set(), set(), 0
    best = [0.0] * len(ref)
    for v, i, j in pairs:
        best[i] = max(best[i], v)
        if v >= thr and i not in used_r and j not in used_g:
            used_r.add(i)
            used_g.add(j)
            matched += 1
    return {"matched": matched, "best_iou": best}


def synthetic_frames(n: int, h: int, w: int, seed: int = 0) -> list[np.ndarray]:
    """Noise backgrounds with a few filled rectangles (something to find at two scales)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
        for _ in range(rng.integers(1, 5)):
            y0, x0 = rng.integers(0, h - 20), rng.integers(0, w - 20)
            y1, x1 = y0 + rng.integers(10, h // 3), x0 + rng.integers(10, w // 3)
            f[y0:y1, x0:x1] = rng.integers(100, 256, 3, dtype=np.uint8)
        out.append(f)
    return out


def load_images(folder: str, limit: int) -> list[np.ndarray]:
    from PIL import Image
    paths = sorted(p for p in Path(folder).iterdir()
                   if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:limit]
    return [np.asarray(Image.open(p).convert("RGB")) for p in paths]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: random weights)")
    ap.add_argument("--images", default=None, help="folder of jpg/png frames")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--object", default="person")
    ap.add_argument("--max-objects", type=int, default=5)
    ap.add_argument("--modes", default="global,overlap:4",
                    help="crop modes compared with the full overlap crops (comma list)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    if args.model:
        from photon_core import load_engine
        engine = load_engine(args.model, device=device, dtype=dtype)
        random_weights = bool(getattr(getattr(engine, "model", engine), "test_model_note", None))
    else:
        from photon_core.fast import FastEngine
        from photon_core.moondream.config import MoondreamConfig
        from photon_core.moondream.model import build_random_model
        from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
        cfg = tiny_config(fast=True) if args.smoke else MoondreamConfig()
        model = build_random_model(cfg, device=device, dtype=dtype, seed=0,
                                   eos_bias=TEST_EOS_BIAS["fast"] if args.smoke else 0.0)
        engine = FastEngine(model, max_batch=2)
        random_weights = True
    frames = (load_images(args.images, args.frames) if args.images
              else synthetic_frames(args.frames, 480, 640))
    task = Task("detect", object=args.object, max_objects=args.max_objects)
    modes = ["overlap"] + [m for m in args.modes.split(",") if m and m != "overlap"]
    res = {m: [] for m in modes}
    enc_ms = {m: [] for m in modes}
    for mode in modes:                                 # warm-up: graph captures
        engine.encode_image(EncodeRequest(frames[0], mode))
    for f in frames:
        for mode in modes:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            enc = engine.encode_image(EncodeRequest(f, mode))
            if cuda:
                torch.cuda.synchronize()
            enc_ms[mode].append((time.perf_counter() - t0) * 1e3)
            res[mode].append(engine.run(enc, task).output["objects"])
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "random_weights": random_weights,
        "frames": len(frames), "object": args.object,
        "encode_ms_overlap_median": round(statistics.median(enc_ms["overlap"]), 3),
        "boxes_full": sum(len(r) for r in res["overlap"]), "modes": {},
    }
    print("| crops | encode ms (median) | boxes | mean best IoU of the full boxes | "
          "recall / precision at IoU 0.5 | frames with the same box count |")
    print("|---|---|---|---|---|---|")
    print(f"| overlap (full) | {out['encode_ms_overlap_median']} | {out['boxes_full']} | "
          "- | - | - |")
    for mode in modes[1:]:
        rows = [match(full, got) for full, got in zip(res["overlap"], res[mode])]
        n_full, n_got = out["boxes_full"], sum(len(r) for r in res[mode])
        matched = sum(r["matched"] for r in rows)
        ious = [v for r in rows for v in r["best_iou"]]
        m = out["modes"][mode] = {
            "encode_ms_median": round(statistics.median(enc_ms[mode]), 3),
            "boxes": n_got,
            "mean_best_iou_of_full_boxes": round(statistics.mean(ious), 4) if ious else None,
            "recall_at_0.5": round(matched / n_full, 4) if n_full else None,
            "precision_at_0.5": round(matched / n_got, 4) if n_got else None,
            "frames_same_box_count": sum(len(a) == len(b)
                                         for a, b in zip(res["overlap"], res[mode])),
        }
        print(f"| {mode} | {m['encode_ms_median']} | {n_got} | "
              f"{m['mean_best_iou_of_full_boxes']} | {m['recall_at_0.5']} / "
              f"{m['precision_at_0.5']} | {m['frames_same_box_count']} of {len(frames)} |")
    if random_weights:
        out["note"] = ("random weights: detections are noise; a plumbing check of the crops "
                       "option, not its effect on quality")
    print(json.dumps(out, indent=1))
    write_json("bench_crop_modes.json", out)


if __name__ == "__main__":
    main()
