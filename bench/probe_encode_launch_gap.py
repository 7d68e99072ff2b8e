"""How long the GPU waits for the encode graph's launch, without the profiler (H200): the
profiled one call run(frame, detect(5)) shows ~110-245 us idle between the frame's upload and
the encode's first kernel (session 21 call 6, session 26 call 4), and CUPTI slows graph
launches. Moondream 2's 640x480 encode graph (FastEngine, random bf16 weights of the real
shapes, the default two parts): CUDA events around each part's replay, once with the GPU idle
when the replay is called (the launch latency is on the GPU's clock) and once behind a busy
GPU (torch.cuda._sleep: the launch hidden), min of --iters; the host's time in each part's
replay() call.

Usage (H200): PYTHONPATH=. python3 bench/probe_encode_launch_gap.py [--iters 20]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    fe = FastEngine(m, max_batch=4)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    for _ in range(3):
        fe.encode_image(frame)
    (e,) = fe.batch_encoder.entries.values()
    parts = list(getattr(e.graph, "graphs", [e.graph]))
    print("parts:", len(parts), flush=True)
    res: dict[str, list] = {}
    for busy in (False, True, False, True):
        for _ in range(args.iters):
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
            if busy:
                torch.cuda._sleep(3_000_000)       # ~1.5 ms of spinning: every launch ahead
            host = []
            ev[0].record()
            for g, end in zip(parts, ev[1:]):
                t0 = time.perf_counter()
                g.replay()
                host.append((time.perf_counter() - t0) * 1e6)
                end.record()
            torch.cuda.synchronize()
            gpu = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(len(parts))]
            key = "busy" if busy else "idle"
            res.setdefault(key + " gpu", []).append(gpu)
            res.setdefault(key + " host", []).append(host)
    for key, rows in res.items():
        a = np.array(rows)
        print(f"{key}: per part us min {np.round(a.min(0), 1).tolist()} median "
              f"{np.round(np.median(a, 0), 1).tolist()}", flush=True)
    idle, busy = np.array(res["idle gpu"]), np.array(res["busy gpu"])
    print("launch wait seen by the GPU (idle - busy, part 1, min / median us):",
          round(float(idle[:, 0].min() - busy[:, 0].min()), 1),
          round(float(np.median(idle[:, 0]) - np.median(busy[:, 0])), 1), flush=True)
    fe.close()


if __name__ == "__main__":
    main()
