"""GEMV configs for a model family's decode step (H200): which (N, K, epilogue) GEMVs the
fused backend launches per step, how long gemv.pick's config takes for each against every
candidate (sweep_gemv.sweep_shape: FMA / DOT forms, split-K for the residual GEMV), and the
step's GEMV time summed over its launches - picked vs the best per shape.

The shapes are recorded on the GPU: the family's model at real shapes with random bf16
weights (bench_qwen3_5.build / bench_gemma4.build, as their fast-path benches build them),
a FastEngine, gemv.pick wrapped while one eager lm + forward runs at batch 1 and at batch 8.

Usage (H200): PYTHONPATH=. python3 bench/sweep_gemv_family.py [--families qwen3.5-0.8b,gemma4-e2b]
                  [--batches 1,8] [--deterministic]
Writes $OUT/sweep_gemv_family.json when OUT is set.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_decode import copy_bandwidth  # noqa: E402
from bench.sweep_gemv import sweep_shape  # noqa: E402
from photon_core.ops import gemv as G  # noqa: E402

C = G.GemvConfig
# small-N forms and short K (per-layer inputs: K = 256) beside sweep_gemv's lists
EXTRA = [C(4, 512, 1, 4, 3, False), C(4, 256, 1, 2, 3, False), C(8, 256, 1, 2, 3, False),
         C(8, 128, 1, 2, 3, False), C(16, 128, 1, 4, 3, False), C(2, 1024, 1, 4, 3, False),
         C(16, 64, 1, 4, 3, True), C(16, 128, 1, 4, 3, True), C(32, 64, 1, 4, 3, True),
         C(4, 512, 2, 4, 3, False), C(4, 512, 4, 4, 3, False), C(8, 256, 4, 4, 3, False),
         C(16, 128, 4, 4, 3, True), C(16, 256, 2, 4, 3, True), C(16, 256, 4, 4, 3, True)]


def build_model(family: str):
    if family.startswith("qwen3.5-"):
        import bench_qwen3_5 as bq
        from photon_core.models.qwen3_5.image_processor import ImageProcessorConfig
        from photon_core.models.qwen3_5.model import Qwen35Model
        size = family.split("-", 1)[1]
        tok, prompts = bq.bench_prompts()
        hf, cfg, weights = bq.build(size, torch.device("cuda"), torch.bfloat16, tok)
        del hf
        return Qwen35Model(cfg, weights, prompts, ImageProcessorConfig(), f"random-{family}")
    if family == "gemma4-e2b":
        from bench_gemma4 import build
        args = argparse.Namespace(smoke=False, no_hf=True, layers=35, kv_shared=20,
                                  kv_heads=1)
        return build(args, torch.device("cuda"), torch.bfloat16)[0]
    if family == "moondream2":
        from photon_core.models.moondream2.config import MoondreamConfig
        from photon_core.models.moondream2.model import build_random_model
        return build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    raise SystemExit(f"unknown family {family}")


def record_shapes(model, batches, deterministic):
    """{b: Counter((n, k, epi) -> launches per step)} of one eager lm + forward at each b."""
    from photon_core.fast import FastEngine
    fe = FastEngine(model, max_batch=max(batches), kv_capacity=1024, megakernel="off",
                    deterministic=deterministic)
    seen: dict[int, collections.Counter] = {}
    pick = G.pick

    def recording(b, n, k, epi, det=False):
        seen.setdefault(b, collections.Counter())[(n, k, epi)] += 1
        return pick(b, n, k, epi, det)
    G.pick = recording
    try:
        with torch.inference_mode():
            for b in batches:
                fe.state.active.zero_()
                for name in ("lm", "forward"):
                    fe.runner.fns[name](fe.state, b)
        torch.cuda.synchronize()
    finally:
        G.pick = pick
        fe.close()
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3.5-0.8b,gemma4-e2b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "copy_bw_TBps": bw / 1e12, "families": {}}
    for fam in args.families.split(","):
        model = build_model(fam)
        seen = record_shapes(model, batches, args.deterministic)
        del model
        torch.cuda.empty_cache()
        res = {}
        shapes = sorted({s for c in seen.values() for s in c})
        for n, k, epi in shapes:
            bs = [b for b in batches if (n, k, epi) in seen.get(b, {})]
            sweep_shape(res, f"{fam} {n}x{k}", n, k, epi, bs, bw, extra=EXTRA,
                        deterministic=args.deterministic, show=4)
        summary = {}
        for b in batches:
            picked = best = floor = 0.0
            for (n, k, epi), cnt in seen.get(b, {}).items():
                r = res[f"{fam} {n}x{k} b={b}"]
                t = {c: us for us, c, _ in r["rows"]}
                picked += cnt * t[r["pick"]]
                best += cnt * r["rows"][0][0]
                floor += cnt * r["floor_us"]
            summary[b] = {"launches": sum(seen.get(b, {}).values()), "picked_us": picked,
                          "best_us": best, "floor_us": floor}
            print(f"\n{fam} b={b}: {summary[b]['launches']} GEMV launches per step; picked "
                  f"{picked:.1f} us, best per shape {best:.1f} us, floor {floor:.1f} us",
                  flush=True)
        out["families"][fam] = {"shapes": {f"{n}x{k} epi{e}": {str(b): seen[b][(n, k, e)]
                                                                for b in seen
                                                                if (n, k, e) in seen[b]}
                                           for n, k, e in shapes},
                                "sweep": res, "summary": summary}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sweep_gemv_family.json").write_text(
            json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
