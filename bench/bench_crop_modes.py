"""What the global-only encode costs in outputs and saves in time: the same frames encoded with
the full overlap crops and with the global view only (EncodeRequest crops="global",
photon_core/encode_request.py), then the same detect task on both; boxes matched greedily by
IoU, the full encode's boxes taken as the reference.

Reported per frame set: encode ms (full / global), detect boxes (full / global), mean IoU of
each full box with its best global box, recall / precision at IoU >= 0.5, frames whose box
count agrees.

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
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    rows, enc_ms = [], {"overlap": [], "global": []}
    for f in frames:                                   # warm-up: graph captures
        for mode in ("overlap", "global"):
            engine.encode_image(EncodeRequest(f, mode))
        break
    for f in frames:
        res = {}
        for mode in ("overlap", "global"):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            enc = engine.encode_image(EncodeRequest(f, mode))
            if cuda:
                torch.cuda.synchronize()
            enc_ms[mode].append((time.perf_counter() - t0) * 1e3)
            res[mode] = engine.run(enc, task).output["objects"]
        m = match(res["overlap"], res["global"])
        rows.append({"full": len(res["overlap"]), "global": len(res["global"]), **m})
    n_full = sum(r["full"] for r in rows)
    n_glob = sum(r["global"] for r in rows)
    matched = sum(r["matched"] for r in rows)
    ious = [v for r in rows for v in r["best_iou"]]
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "random_weights": random_weights,
        "frames": len(frames), "object": args.object,
        "encode_ms_overlap_median": round(statistics.median(enc_ms["overlap"]), 3),
        "encode_ms_global_median": round(statistics.median(enc_ms["global"]), 3),
        "boxes_full": n_full, "boxes_global": n_glob,
        "mean_best_iou_of_full_boxes": round(statistics.mean(ious), 4) if ious else None,
        "recall_at_0.5": round(matched / n_full, 4) if n_full else None,
        "precision_at_0.5": round(matched / n_glob, 4) if n_glob else None,
        "frames_same_box_count": sum(r["full"] == r["global"] for r in rows),
    }
    if random_weights:
        out["note"] = ("random weights: detections are noise; a plumbing check of the crops "
                       "option, not its effect on quality")
    print("| crops | encode ms (median) | boxes |")
    print("|---|---|---|")
    print(f"| overlap (full) | {out['encode_ms_overlap_median']} | {n_full} |")
    print(f"| global only | {out['encode_ms_global_median']} | {n_glob} |")
    print(json.dumps(out, indent=1))
    od = os.environ.get("OUT")
    if od:
        Path(od).mkdir(parents=True, exist_ok=True)
        (Path(od) / "bench_crop_modes.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
