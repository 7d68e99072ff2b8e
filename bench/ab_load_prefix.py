"""A task's start copies its image's prefix k/v into its state-cache row
(StaticKVCache.load_prefix): torch's strided copy_ against ops/kv_block_copy.py, same process
(H200, random weights of the real shapes): the copy alone (CUDA events, median of --iters),
its bytes per second, the row's bits, and run(frame, task) end to end with each form (min
of --iters, forms alternating over --rounds). Also the host time of one encode-graph replay
call (how long the host takes to launch it: the GPU idles that long after the frame's
upload).

Usage (GPU): PYTHONPATH=. python3 bench/ab_load_prefix.py [--families moondream2,qwen3.5-0.8b]
             [--rounds 2] [--iters 10]
Writes $OUT/ab_load_prefix.json when OUT is set.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_timing import call_times  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="moondream2,qwen3.5-0.8b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    from photon_core.ops import kv_block_copy as K
    from photon_core.task import Task
    real = K.kernel_runs
    forms = {"torch copy_": lambda t: False, "kv_block_copy": real}
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = {"gpu": torch.cuda.get_device_name(), "families": {}}
    for fam in args.families.split(","):
        model = build_model(fam)
        fe = FastEngine(model)
        task = Task("detect", object="person", max_objects=5) if fam == "moondream2" else \
            Task("query", question="What is in the image?", max_tokens=32)
        enc = fe.encode_image(frame)
        prefix = fe.family.prefix(enc)
        kv = fe.kv
        res = out["families"][fam] = {"task": task.skill}
        nbytes = (prefix.kv.numel() * prefix.kv.element_size() if prefix.kv is not None
                  and not isinstance(prefix.kv, (list, tuple)) else
                  sum(t.numel() * t.element_size() for t in prefix.kv))
        res["prefix_MiB"] = nbytes / 2 ** 20
        rows = {}
        for name, fn in forms.items():
            K.kernel_runs = fn
            ms = statistics.median(call_times(lambda: kv.load_prefix(1, prefix), "cuda",
                                              args.iters * 5))
            torch.cuda.synchronize()
            row = kv.data[:, :, 1] if kv.data is not None else \
                torch.cat([kv.k[i][1].flatten() for i in kv.layers])
            rows[name] = row.clone()
            res[f"copy_ms {name}"] = ms
            print(f"{fam}: load_prefix with {name}: {ms:.4f} ms ({2 * nbytes / ms / 1e6:.0f} "
                  f"GB/s read + write, {nbytes / 2**20:.1f} MiB)", flush=True)
        a, b = rows.values()
        res["same_row"] = bool(torch.equal(a, b))
        print(f"{fam}: the row bitwise the same: {res['same_row']}", flush=True)
        for r in range(args.rounds):
            for name, fn in forms.items():
                K.kernel_runs = fn
                walls = []
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fe.run(frame, task)
                    torch.cuda.synchronize()
                    walls.append((time.perf_counter() - t0) * 1e3)
                res.setdefault(f"run_ms {name}", []).append(min(walls))
                print(f"{fam} round {r}: run(frame, {task.skill}) with {name}: "
                      f"{min(walls):.2f} ms (median {statistics.median(walls):.2f})", flush=True)
        K.kernel_runs = real
        enc_ = fe.batch_encoder if fam == "moondream2" else fe.encoder
        g = next(iter(enc_.entries.values())).graph
        host = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        res["encode_replay_host_us"] = statistics.median(host)
        print(f"{fam}: the encode graph's replay() returns after {statistics.median(host):.0f} us "
              f"of host time (median)", flush=True)
        fe.close()
        del fe, model
        torch.cuda.empty_cache()
    write_json("ab_load_prefix.json", out)


if __name__ == "__main__":
    main()
