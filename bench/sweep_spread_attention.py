"""The decode attention of several rows: the capacity-wide kernel (_attend_partial_kernel,
ROWS_CHUNK keys x ROWS_WARPS) against _attend_spread_kernel (each row's keys up to its own
position in spread_splits parts) over its settings - programs aimed at (SPREAD_PROGRAMS),
keys per chunk, warps, pipeline stages - (H200, Moondream 2 shapes: 32 heads of 64, bf16):
each setting as a CUDA graph of one call per layer over 24 layers' distinct caches (nothing
stays in L2), us per layer and GB/s of k/v read; outputs diffed against the capacity-wide
kernel's.

Usage: PYTHONPATH=. python3 bench/sweep_spread_attention.py [--batches 2,4,8] [--pos 300,760]
           [--cap 1024] [--programs 256,512,1024] [--chunks 64,128] [--warps 2,4] [--stages 1,2]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
import photon_core.ops.decode_attention as DA  # noqa: E402
from photon_core.ops.rope import rope_angles  # noqa: E402

NH, HD, LAYERS, ROT = 32, 64, 24, 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--pos", default="300,760")
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--programs", default="256,512,1024")
    ap.add_argument("--chunks", default="64,128")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--stages", default="1,2")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]    # noqa: E731
    dev, cap = "cuda", args.cap
    cos, sin = (t.contiguous().to(dev) for t in rope_angles(torch.arange(cap + 1), ROT))
    g = torch.Generator(device=dev).manual_seed(0)
    keep = (DA.SPREAD, DA.SPREAD_PROGRAMS, DA.SPREAD_CHUNK, DA.SPREAD_WARPS, DA.SPREAD_STAGES)
    for b, p0 in itertools.product(ints(args.batches), ints(args.pos)):
        kv = torch.randn(LAYERS, 2, b, NH, cap, HD, device=dev, dtype=torch.bfloat16,
                         generator=g)
        qkv = torch.randn(LAYERS, b, 3 * NH * HD, device=dev, dtype=torch.bfloat16,
                          generator=g)
        pos = torch.arange(p0, p0 - b, -1, device=dev)
        res = torch.empty(LAYERS, b, NH * HD, device=dev, dtype=torch.bfloat16)
        kv_bytes = sum(2 * NH * (int(p) + 1) * HD * 2 for p in pos.tolist())
        scratch = DA.AttentionScratch(b, NH, HD, cap, 128, dev, min_chunk=DA.ROWS_CHUNK)

        def measure(spread, programs=0, chunk=0, warps=0, stages=0):
            DA.SPREAD, DA.SPREAD_PROGRAMS = spread, programs
            DA.SPREAD_CHUNK, DA.SPREAD_WARPS, DA.SPREAD_STAGES = chunk, warps, stages

            def run():
                for i in range(LAYERS):
                    DA.decode_attention(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1], res[i],
                                        scratch, NH, NH, HD)
            run()
            torch.cuda.synchronize()
            out = res.clone()
            return graph_ms(run, calls=3) * 1e3 / LAYERS, out
        base_us, base = measure(False)
        print(f"b={b} pos {p0}: capacity-wide {base_us:.2f} us/layer "
              f"({kv_bytes / (base_us * 1e-6) / 1e9:.0f} GB/s)", flush=True)
        for programs, chunk, warps, stages in itertools.product(
                ints(args.programs), ints(args.chunks), ints(args.warps), ints(args.stages)):
            try:
                us, out = measure(True, programs, chunk, warps, stages)
            except Exception as e:      # noqa: BLE001 - a setting that does not build: say so
                print(f"  {programs}/{chunk}/w{warps}/s{stages}: {type(e).__name__}: "
                      f"{str(e)[:100]}")
                continue
            diff = (out.float() - base.float()).abs().max().item()
            print(f"  spread {programs}/{chunk}/w{warps}/s{stages} "
                  f"({DA.spread_splits(b, NH, scratch)} splits): {us:.2f} us/layer "
                  f"({kv_bytes / (us * 1e-6) / 1e9:.0f} GB/s, {base_us / us:.2f}x), "
                  f"max diff {diff:.3g}", flush=True)
        del kv, qkv
        torch.cuda.empty_cache()
    (DA.SPREAD, DA.SPREAD_PROGRAMS, DA.SPREAD_CHUNK, DA.SPREAD_WARPS, DA.SPREAD_STAGES) = keep


if __name__ == "__main__":
    main()
