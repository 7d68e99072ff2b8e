"""The decode attention kernel forms on the GPU at Moondream 2's shapes (32 heads of 64, KV
capacity 832, rows at positions ~785, bf16): the one-chunk kernel (+ combine) against the
streamed form (ops/decode_attention.py _attend_stream_kernel) over a grid of its knobs
(programs per launch, keys per block, pipeline stages, warps), at several batch sizes.
Each measurement is a CUDA graph of one attention call per layer over 24 distinct layers'
caches (as in a step: nothing stays in L2), us per layer; the k/v bytes read give GB/s
against the copy bandwidth measured in the same run. Each streamed output is diffed
against the one-chunk kernel's (max abs difference, bf16 outputs).

Usage: PYTHONPATH=. python3 bench/bench_decode_attention.py [--batches 2,4,8]
           [--programs 256,512,1024] [--blocks 32,64,128] [--stages 2,3,4] [--warps 4]
Writes $OUT/bench_decode_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_megakernel as bm  # noqa: E402

NH, HD, CAP, POS, LAYERS, ROT = 32, 64, 832, 785, 24, 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--programs", default="256,512,1024")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--warps", default="4")
    args = ap.parse_args()
    import torch

    import photon_core.ops.decode_attention as DA
    from photon_core.ops.rope import rope_angles
    ints = lambda s: [int(v) for v in s.split(",")]   # noqa: E731
    dev = "cuda"
    n = 2 ** 28
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    z = torch.empty_like(a)
    bw = 2 * a.numel() * 2 / (bm._timed(torch, lambda: z.copy_(a), reps=5) * 1e-3)
    del a, z
    out = {"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    cos, sin = (t.contiguous().to(dev) for t in rope_angles(torch.arange(CAP + 1), ROT))
    g = torch.Generator(device=dev).manual_seed(0)
    for b in ints(args.batches):
        kv = torch.randn(LAYERS, 2, b, NH, CAP, HD, device=dev, dtype=torch.bfloat16,
                         generator=g)
        qkv = torch.randn(LAYERS, b, 3 * NH * HD, device=dev, dtype=torch.bfloat16,
                          generator=g)
        pos = torch.arange(POS, POS - b, -1, device=dev)
        res = torch.empty(LAYERS, b, NH * HD, device=dev, dtype=torch.bfloat16)
        scratch = DA.AttentionScratch(b, NH, HD, CAP, 128, dev)
        kv_bytes = LAYERS * sum(2 * NH * (int(p) + 1) * HD * 2 for p in pos.tolist())

        def run(stream):
            for i in range(LAYERS):
                DA.decode_attention(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1], res[i],
                                    scratch, NH, NH, HD, stream=stream)

        def timed(stream):
            run(stream)
            snap = res.clone()
            gr = bm._graph(torch, lambda: run(stream))
            us = bm._timed(torch, gr.replay) * 1e3 / LAYERS
            return us, snap
        base_us, base = timed(False)
        row = {"b": b, "one_chunk_us": base_us,
               "one_chunk_GBps": kv_bytes / LAYERS / (base_us * 1e-6) / 1e9, "stream": []}
        print(f"b={b}: one-chunk {base_us:.2f} us/layer "
              f"({row['one_chunk_GBps']:.0f} GB/s)", flush=True)
        for progs, block, stages, warps in itertools.product(
                ints(args.programs), ints(args.blocks), ints(args.stages), ints(args.warps)):
            DA.STREAM_PROGRAMS, DA.STREAM_BLOCK = progs, block
            DA.STREAM_STAGES, DA.STREAM_WARPS = stages, warps
            try:
                us, got = timed(True)
            except Exception as e:       # a config that does not compile / fit: say so
                print(f"  programs {progs} block {block} stages {stages} warps {warps}: "
                      f"{type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            diff = (got.float() - base.float()).abs().max().item()
            ns, span = DA.stream_splits(b, NH, CAP, scratch.n_split)
            r = {"programs": progs, "block": block, "stages": stages, "warps": warps,
                 "splits": ns, "span": span, "us": us,
                 "GBps": kv_bytes / LAYERS / (us * 1e-6) / 1e9, "max_diff": diff}
            row["stream"].append(r)
            print(f"  programs {progs} block {block} stages {stages} warps {warps} "
                  f"(splits {ns} x {span} keys): {us:.2f} us/layer ({r['GBps']:.0f} GB/s, "
                  f"{base_us / us:.2f}x), max diff {diff:.3g}", flush=True)
        best = min(row["stream"], key=lambda r: r["us"], default=None)
        if best:
            print(f"  best b={b}: {best}", flush=True)
        out["rows"].append(row)
        del kv, qkv
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_decode_attention.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
