"""Moondream 2's image-prefix prefill (the fused form, 730 tokens) with and without its last
layer's tail (prefix_prefill hidden=False: the pass stops at the last k/v write, what the
runtime's encode runs since session 13), same process: CUDA graphs of each form at 1 and 4
frames, alternating rounds, and whether the two forms' k/v are bitwise equal.

Usage (H200): PYTHONPATH=. python3 bench/ab_prefix_kv_only.py [--rounds 2] [--calls 10]
Writes $OUT/ab_prefix_kv_only.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
from photon_core.models.moondream2 import batched_encode  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10, help="prefills per graph")
    args = ap.parse_args()
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    w, t = m.weights, m.config.text
    out = {"gpu": torch.cuda.get_device_name(), "frames": {}}
    with torch.inference_mode():
        for n in (1, 4):
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn(n, m.prefix_len, t.dim, device="cuda", dtype=w.dtype, generator=g)
            kvs = {h: batched_encode.kv_buffer(m, n) for h in (True, False)}
            ms = {True: [], False: []}
            for _ in range(args.rounds):
                for hidden in (True, False):
                    def run(hidden=hidden):
                        return prefill_prefix(w, t, x, kvs[hidden], m.prefix_len, fast=True,
                                              hidden=hidden)
                    ms[hidden].append(graph_ms(run, calls=args.calls))
            r = out["frames"][n] = {
                "whole_ms": round(min(ms[True]), 4), "kv_only_ms": round(min(ms[False]), 4),
                "rounds": {"whole": ms[True], "kv_only": ms[False]},
                "kv_bitwise_equal": bool(torch.equal(kvs[True], kvs[False]))}
            print(f"{n} frame(s): whole pass {r['whole_ms']:.3f} ms -> stop at the last k/v "
                  f"write {r['kv_only_ms']:.3f} ms ({r['whole_ms'] / r['kv_only_ms']:.3f}x); "
                  f"k/v bitwise equal: {r['kv_bitwise_equal']}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ab_prefix_kv_only.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
