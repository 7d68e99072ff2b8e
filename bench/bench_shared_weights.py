"""GPU memory and speed of a FastEngine with the fused backend's joined weights held once
(fused_backend.SHARE_WEIGHTS: the model's weights become views of the joined GEMV weights)
against held twice (the joined copies beside the model's own tensors), on the H200; with
Gemma 4 also its fast vision tower's joined q | k | v and gate | up (vision_fast.SHARE_JOINED,
made at the first encode: "first_encode_MiB" is what that encode leaves allocated).

Per family and round, each form in a fresh model (the sharing happens in the first engine
built on a model, so one model cannot carry both forms), alternating the order per round:
torch.cuda.memory_allocated() after the model and after FastEngine(model) (defaults), the
engine's 640x480 encode (graph replay, min of --iters; Moondream 2: the batch encoder's
graph, Qwen 3.5: the family encoder's), one task as run(frame, task) (min wall of --iters),
and whether the task's output is the same in every form and round (with --deterministic:
engines without split-K GEMVs, whose outputs repeat; the default engine's split-K sums vary
from run to run) and the encode's k/v digest (Moondream 2).

Usage: PYTHONPATH=. python3 bench/bench_shared_weights.py [--families moondream2,qwen3.5-0.8b]
           [--rounds 2] [--iters 10] [--deterministic]
Writes $OUT/bench_shared_weights.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.out_dir import write_json  # noqa: E402
from bench.bench_timing import call_times  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def _sha(t: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()
                          ).hexdigest()[:16]


def one(family: str, share: bool, iters: int, frame, deterministic: bool = False) -> dict:
    from photon_core.fast import FastEngine
    from photon_core.fast import fused_backend
    from photon_core.task import Task
    from photon_core.models.gemma4 import vision_fast
    fused_backend.SHARE_WEIGHTS = share
    vision_fast.SHARE_JOINED = share
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = build_model(family)
    torch.cuda.synchronize()
    after_model = torch.cuda.memory_allocated()
    fe = FastEngine(model, deterministic=True) if deterministic else FastEngine(model)
    torch.cuda.synchronize()
    after_engine = torch.cuda.memory_allocated()
    task = Task("detect", object="person", max_objects=5) if family == "moondream2" else \
        Task("query", question="What is in the image?", max_tokens=32)
    encoded = fe.encode_image(frame)
    torch.cuda.synchronize()
    after_encode = torch.cuda.memory_allocated()
    kv_sha = _sha(encoded.kv) if family == "moondream2" else None
    del encoded
    enc = fe.batch_encoder if family == "moondream2" else fe.encoder
    replay = min(call_times(next(iter(enc.entries.values())).graph.replay, "cuda", iters,
                            warmup=0))
    walls, out = [], None
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fe.run(frame, task)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        out = repr(r.output) if hasattr(r, "output") else repr(r)
    fd = fe.state.fused
    res = {"share": share, "model_MiB": round((after_model - base) / 2 ** 20),
           "engine_MiB": round((after_engine - after_model) / 2 ** 20),
           "shared_MiB": round((fd.shared_bytes if fd else 0) / 2 ** 20),
           "first_encode_MiB": round((after_encode - after_engine) / 2 ** 20),
           "encode_replay_ms": round(replay, 3), "run_ms": round(min(walls), 2),
           "task": task.skill, "output": out, "encode_kv_sha": kv_sha}
    fe.close()
    del fe, model, enc
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="moondream2,qwen3.5-0.8b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--deterministic", action="store_true",
                    help="engines in deterministic mode (no split-K GEMV: repeatable outputs)")
    args = ap.parse_args()
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = {"gpu": torch.cuda.get_device_name(), "families": {}}
    for family in args.families.split(","):
        rows = []
        for r in range(args.rounds):
            for share in ((False, True) if r % 2 == 0 else (True, False)):
                res = one(family, share, args.iters, frame, args.deterministic)
                rows.append(res)
                print(family, {k: v for k, v in res.items() if k != "output"}, flush=True)
        same = len({r["output"] for r in rows}) == 1
        out["families"][family] = {"rows": rows, "outputs_equal": same}
        print(f"{family}: outputs equal in every form and round: {same}", flush=True)
    write_json("bench_shared_weights.json", out)


if __name__ == "__main__":
    main()
