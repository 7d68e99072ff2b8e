"""Benchmark + precision check of the Moondream 2 reference path (eager PyTorch).

1. Timings at real Moondream 2 shapes with random weights (built in memory, no checkpoint):
   encode_image of a 640x480 frame (9 crops + 730-token prefill), detect forced to 5 objects
   (15 decode steps), query forced to exactly 32 tokens (ignore_eos test hook).
2. bf16 vs fp32 agreement of all four skills on the small test config (same seed).

Usage: python bench/bench_reference.py [--device cuda] [--dtype bf16] [--iters 5]
Prints a markdown table; writes $OUT/bench_reference.json when OUT is set.
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

from photon_core.moondream.config import MoondreamConfig  # noqa: E402
from photon_core.moondream.model import build_random_model  # noqa: E402
from photon_core.moondream import text  # noqa: E402
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config  # noqa: E402
from photon_core.task import Task  # noqa: E402


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, iters, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def forced(model, enc, task):
    run = model.start(enc, task, ignore_eos=True)
    while run.step():
        pass
    return run.result()


def bench_real_shapes(device, dtype, iters):
    model = build_random_model(MoondreamConfig(), device=device, dtype=dtype, seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    rows = {}
    enc_ms, enc = timed(lambda: model.encode_image(frame), device, iters)
    rows["encode_image 640x480 (9 crops + prefix)"] = {"ms": enc_ms, "tiling": list(enc.tiling)}
    det = Task("detect", object="person", max_objects=5)
    ms, res = timed(lambda: forced(model, model.encode_image(frame), det), device, iters)
    rows["encode + detect (5 objects forced)"] = {
        "ms": ms, "steps": res.tokens, "prefill_ms": res.timings["prefill_ms"],
        "per_step_ms": res.timings["decode_ms"] / max(1, res.tokens)}
    q = Task("query", question="What is in the image?", max_tokens=32)
    ms, res = timed(lambda: forced(model, model.encode_image(frame), q), device, iters)
    rows["encode + query (32 tokens forced)"] = {
        "ms": ms, "steps": res.tokens, "prefill_ms": res.timings["prefill_ms"],
        "per_step_ms": res.timings["decode_ms"] / max(1, res.tokens)}
    if torch.device(device).type == "cuda":
        rows["peak memory GiB"] = {"ms": float("nan"),
                                   "gib": torch.cuda.max_memory_allocated() / 2 ** 30}
    del model
    return rows


def agreement(device, seed=0):
    """Same random weights (fp32 master, cast) in fp32 and bf16; compare all four skills."""
    cfg = tiny_config()
    bias = TEST_EOS_BIAS["reference"]
    m32 = build_random_model(cfg, device=device, dtype="fp32", seed=seed, eos_bias=bias)
    m16 = build_random_model(cfg, device=device, dtype="bf16", seed=seed, eos_bias=bias)
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
              for h, w in ((480, 640), (240, 320), (720, 1280))]
    tasks = [Task("detect", object="person", max_objects=10), Task("point", object="cup", max_objects=10),
             Task("query", question="What is it?", max_tokens=32),
             Task("caption", caption_length="short", max_tokens=32)]
    out = []
    for i, frame in enumerate(frames):
        e32, e16 = m32.encode_image(frame), m16.encode_image(frame)
        for task in tasks:
            r32, r16 = m32.start(e32, task), m16.start(e16, task)
            l32 = text.lm_head(m32.weights, r32.hidden[0, 0]).float()
            l16 = text.lm_head(m16.weights, r16.hidden[0, 0]).float()
            cos = torch.nn.functional.cosine_similarity(l32, l16, dim=0).item()
            for r in (r32, r16):
                while r.step():
                    pass
            o32, o16 = r32.result().output, r16.result().output
            row = {"frame": i, "skill": task.skill, "prompt_logit_cos": cos,
                   "first_token_same": r32.next_token == r16.next_token or None}
            if task.skill in ("detect", "point"):
                k = "objects" if task.skill == "detect" else "points"
                a, b = o32[k], o16[k]
                row["count_fp32"], row["count_bf16"] = len(a), len(b)
                diffs = [abs(x[c] - y[c]) for x, y in zip(a, b) for c in x]
                row["max_coord_diff"] = max(diffs) if diffs else 0.0
                row["identical"] = a == b
            else:
                k = "answer" if task.skill == "query" else "caption"
                a, b = o32[k], o16[k]
                same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                row["common_prefix_chars"], row["len_fp32"], row["len_bf16"] = same, len(a), len(b)
                row["identical"] = a == b
            out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-real", action="store_true", help="only the agreement check")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    if not args.skip_real:
        rows = bench_real_shapes(args.device, args.dtype, args.iters)
        result["timings"] = rows
        print(f"\n### Moondream 2 reference path, real shapes, random weights "
              f"({args.device}, {args.dtype}, median of {args.iters})\n")
        print("| what | ms | steps | per step ms | prefill ms |\n|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['ms']:.1f} | {r.get('steps', '')} | "
                  f"{r.get('per_step_ms', float('nan')):.2f} | {r.get('prefill_ms', float('nan')):.1f} |"
                  + (f" {r['gib']:.1f} GiB" if "gib" in r else ""))
    agree = agreement(args.device)
    result["bf16_vs_fp32"] = agree
    print("\n### bf16 vs fp32 (small test config, same weights)\n")
    print("| frame | skill | prompt logits cos | identical | details |\n|---|---|---|---|---|")
    for r in agree:
        details = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                   if k not in ("frame", "skill", "prompt_logit_cos", "identical")}
        print(f"| {r['frame']} | {r['skill']} | {r['prompt_logit_cos']:.5f} | {r['identical']} | {details} |")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_reference.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
