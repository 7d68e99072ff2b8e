"""Would the vision encoder be faster with its crops split over CUDA streams? (issue 13's
14 ms encode). One 640x480 frame's 9 crops through vision_fused.encoder (real Moondream 2
shapes, random bf16 weights) as a CUDA graph: one call over the 9 crops against the crops
split into groups, each group's encoder on its own stream (forked from and joined to the
capturing stream, so the graph holds parallel branches and one group's attention / norms
can overlap another's GEMMs and fill the kernels' ramps and tails). Same run; each split's
output is diffed against the one-call output (cuBLAS may pick other GEMM kernels for the
smaller M: close, not bitwise).

Usage: PYTHONPATH=. python3 bench/probe_vision_streams.py [--splits "9;5,4"] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
from photon_core.models.moondream2 import vision_fused  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402


def split_encoder(w, v, x, sizes, streams):
    """vision_fused.encoder over consecutive groups of x's crops, group i on streams[i]."""
    main = torch.cuda.current_stream()
    outs, start = [], 0
    for n, s in zip(sizes, streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(vision_fused.encoder(w, v, x[start:start + n]))
        start += n
    for s in streams:
        main.wait_stream(s)
    return torch.cat(outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", default="9;5,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    v, w = m.config.vision, m.weights
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    splits = [[int(s) for s in sp.split(",")] for sp in args.splits.split(";")]
    with torch.inference_mode():
        _, x, _ = m.image_crops(frame)
        assert all(sum(sp) == x.shape[0] for sp in splits), (x.shape, splits)
        ref = vision_fused.encoder(w, v, x)
        streams = [torch.cuda.Stream() for _ in range(max(len(sp) for sp in splits))]
        times = {str(sp): [] for sp in splits}
        for _ in range(args.rounds):          # alternate the forms, a median per form
            for sp in splits:
                if len(sp) == 1:
                    fn = lambda: vision_fused.encoder(w, v, x)     # noqa: E731
                else:
                    fn = lambda sp=sp: split_encoder(w, v, x, sp, streams)   # noqa: E731
                times[str(sp)].append(graph_ms(fn, calls=5))
        for sp in splits:
            out = ref if len(sp) == 1 else split_encoder(w, v, x, sp, streams)
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            ms = statistics.median(times[str(sp)])
            print(f"crops {sp}: vision graph {ms:.3f} ms (rounds {[round(t, 3) for t in times[str(sp)]]}), "
                  f"max diff vs one call {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
