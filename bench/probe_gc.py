"""What Python's garbage collector costs one call run(frame, task), per call (issue 13's
encode + detect(5) <= 30 ms, and the live node's deadlines): the loaded process holds
millions of objects (torch, the model's modules, transformers' tokenizer) that every full
(generation 2) collection walks, and a call allocates enough objects to trigger
collections. gc.callbacks time each collection; each call is timed alone (synchronized).

Modes, alternating in rounds in this one process: "default" (gc as Python sets it),
"freeze" (gc.freeze() before the round: every object alive then moves to the permanent
generation, no collection walks it; gc.unfreeze() after). Also: the objects gc tracks, and
one forced full collection's time with and without the freeze (the worst pause a call can
meet).

Moondream 2 shapes, random bf16 weights, FastEngine defaults (megakernel "auto").
Usage (GPU): PYTHONPATH=. python3 bench/probe_gc.py [--tasks detect5] [--calls 50]
             [--rounds 4]
CPU smoke run (the tiny test model): PYTHONPATH=. python3 bench/probe_gc.py --tiny
Writes $OUT/probe_gc.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.e2e_timeline import TASKS  # noqa: E402
from bench.out_dir import write_json  # noqa: E402


class GcTimer:
    """Collections (count, ms) by generation since the last reset, via gc.callbacks."""

    def __init__(self):
        self.t0 = 0.0
        self.reset()
        gc.callbacks.append(self._cb)

    def reset(self):
        self.ms = [0.0, 0.0, 0.0]
        self.n = [0, 0, 0]

    def _cb(self, phase, info):
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.ms[g] += (time.perf_counter() - self.t0) * 1e3
            self.n[g] += 1


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def pct(xs: list, q: float) -> float:
    return round(float(np.percentile(xs, q)), 3)


def summary(walls: list, gcs: list, ns: list) -> dict:
    return {"calls": len(walls), "wall_ms_mean": round(float(np.mean(walls)), 3),
            "p50": pct(walls, 50), "p90": pct(walls, 90), "p99": pct(walls, 99),
            "max": round(max(walls), 3),
            "gc_ms_per_call_mean": round(float(np.mean(gcs)), 4),
            "gc_ms_per_call_max": round(max(gcs), 3),
            "collections_by_generation": [int(sum(n[g] for n in ns)) for g in range(3)]}


def run_calls(fe, frame, task, calls: int, timer: GcTimer, dev) -> tuple[list, list, list]:
    walls, gcs, ns = [], [], []
    for _ in range(calls):
        timer.reset()
        sync(dev)
        t0 = time.perf_counter()
        fe.run(frame, task, ignore_eos=True)
        sync(dev)
        walls.append((time.perf_counter() - t0) * 1e3)
        gcs.append(sum(timer.ms))
        ns.append(list(timer.n))
    return walls, gcs, ns


def full_collection_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return round((time.perf_counter() - t0) * 1e3, 2)


def build(tiny: bool):
    from photon_core.fast import FastEngine
    if tiny:
        from photon_core.models.moondream2.test_model import tiny_config
        from photon_core.models.moondream2.model import build_random_model
        m = build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)
        frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    else:
        from photon_core.models.moondream2.config import MoondreamConfig
        from photon_core.models.moondream2.model import build_random_model
        m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
        frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    return FastEngine(m, max_batch=4), frame, m.weights.device


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="detect5")
    ap.add_argument("--calls", type=int, default=50, help="calls per mode and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU")
    args = ap.parse_args()
    fe, frame, dev = build(args.tiny)
    timer = GcTimer()
    out: dict = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "thresholds": gc.get_threshold(), "tracked_objects": len(gc.get_objects()),
                 "full_collection_ms": full_collection_ms()}
    gc.freeze()
    out["full_collection_ms_frozen"] = full_collection_ms()
    gc.unfreeze()
    for name in args.tasks.split(","):
        task = TASKS[name]
        for _ in range(3):
            fe.run(frame, task, ignore_eos=True)
        res = {m: ([], [], []) for m in ("default", "freeze")}
        for _ in range(args.rounds):
            for mode in ("default", "freeze"):
                if mode == "freeze":
                    gc.freeze()
                w, g, n = run_calls(fe, frame, task, args.calls, timer, dev)
                if mode == "freeze":
                    gc.unfreeze()
                for acc, new in zip(res[mode], (w, g, n)):
                    acc.extend(new)
        out[name] = {m: summary(*v) for m, v in res.items()}
        print(json.dumps({name: out[name]}), flush=True)
    print(json.dumps({k: v for k, v in out.items() if k not in args.tasks.split(",")}))
    write_json("probe_gc.json", out)


if __name__ == "__main__":
    main()
