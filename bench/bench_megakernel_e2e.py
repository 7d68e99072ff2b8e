"""End to end with the megakernel backend (issue 12): 640x480 encode + detect(5) and encode +
query(32) on the H200, Moondream 2 shapes, random bf16 weights, one process, engines
alternating round by round: the fused backend (default split-K mode and deterministic mode)
against EngineOptions(megakernel="on") (deterministic, the megakernel at bucket 1). Also
says whether the megakernel engine's detect / point / query outputs equal the deterministic
fused engine's (greedy, to EOS), and its decode step as a graph replay; the seconds each engine
takes to build (the first "on" build compiles the megakernel unless Triton's cache has it),
and an "on" and a fused build again (a restart with the cache warm).

Usage: PYTHONPATH=. python3 bench/bench_megakernel_e2e.py [--iters 10] [--rounds 2]
Writes $OUT/bench_megakernel_e2e.json when OUT is set.
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

from bench.bench_decode import e2e, graph_step_ms  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.task import Task  # noqa: E402

ENGINES = {"fused (split-K)": dict(megakernel="off"),
           "fused (deterministic)": dict(deterministic=True, megakernel="off"),
           "megakernel on": dict(deterministic=True, megakernel="on")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    detect = Task("detect", object="person", max_objects=5)
    query = Task("query", question="What is in the image?", max_tokens=32)
    point = Task("point", object="cup", max_objects=5)
    engines, build_s = {}, {}
    for k, kw in ENGINES.items():
        t0 = time.perf_counter()
        engines[k] = FastEngine(m, max_batch=4, **kw)
        torch.cuda.synchronize()
        build_s[k] = round(time.perf_counter() - t0, 2)
    # the same "on" engine again: what a restart costs with Triton's cache warm
    t0 = time.perf_counter()
    FastEngine(m, max_batch=4, **ENGINES["megakernel on"]).close()
    build_s["megakernel on, again (cache warm)"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    FastEngine(m, max_batch=4, **ENGINES["fused (split-K)"]).close()
    build_s["fused (split-K), again"] = round(time.perf_counter() - t0, 2)
    out: dict = {"gpu": torch.cuda.get_device_name(), "engine_build_s": build_s,
                 "megakernel_fallback": engines["megakernel on"].metrics().get(
                     "megakernel_fallback")}
    res: dict = {k: {"detect5": [], "query32": []} for k in engines}
    for _ in range(args.rounds):
        for name, fe in engines.items():
            res[name]["detect5"].append(e2e(fe, frame, detect, args.iters)["ms"])
            res[name]["query32"].append(e2e(fe, frame, query, args.iters)["ms"])
    for name, fe in engines.items():
        out[name] = {k: round(statistics.median(v), 3) for k, v in res[name].items()}
        out[name]["step_b1_graph_ms"] = round(graph_step_ms(fe, 1), 4)
    ref, mk = engines["fused (deterministic)"], engines["megakernel on"]
    same = {}
    for t in (detect, point, query):
        enc = ref.encode_image(frame)
        a, b = ref.run(enc, t), mk.run(enc, t)
        same[t.skill] = (a.tokens == b.tokens and str(a.output) == str(b.output))
    out["outputs_equal_to_deterministic_fused"] = same
    print(json.dumps(out, indent=1))
    print(f"engine build s: {build_s}")
    print("\n| engine | encode + detect(5) ms | encode + query(32) ms | step b1 graph ms |")
    print("|---|---|---|---|")
    for name in engines:
        r = out[name]
        print(f"| {name} | {r['detect5']} | {r['query32']} | {r['step_b1_graph_ms']} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_megakernel_e2e.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
