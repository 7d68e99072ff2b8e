"""The decode attention kernel's warps and key chunk at several batch sizes (H200, Moondream 2
shapes: 32 heads of 64, KV capacity 832, rows at positions ~785, bf16): each setting as a
CUDA graph of one call per layer over 24 layers' distinct caches (nothing stays in L2), us
per layer and GB/s of k/v read, against the shipped setting (4 warps, chunk 128) in the
same run; outputs diffed against the shipped setting's.

Usage: PYTHONPATH=. python3 bench/bench_attention_warps.py [--batches 1,2,4,8]
           [--warps 1,2,4,8] [--chunks 64,128,256]
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

NH, HD, CAP, POS, LAYERS, ROT = 32, 64, 832, 785, 24, 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--chunks", default="64,128,256")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]    # noqa: E731
    dev = "cuda"
    cos, sin = (t.contiguous().to(dev) for t in rope_angles(torch.arange(CAP + 1), ROT))
    g = torch.Generator(device=dev).manual_seed(0)
    for b in ints(args.batches):
        kv = torch.randn(LAYERS, 2, b, NH, CAP, HD, device=dev, dtype=torch.bfloat16,
                         generator=g)
        qkv = torch.randn(LAYERS, b, 3 * NH * HD, device=dev, dtype=torch.bfloat16,
                          generator=g)
        pos = torch.arange(POS, POS - b, -1, device=dev)
        res = torch.empty(LAYERS, b, NH * HD, device=dev, dtype=torch.bfloat16)
        kv_bytes = sum(2 * NH * (int(p) + 1) * HD * 2 for p in pos.tolist())

        def measure(warps, chunk):
            DA.ATTEND_WARPS = warps
            scratch = DA.AttentionScratch(b, NH, HD, CAP, chunk, dev)

            def run():
                for i in range(LAYERS):
                    DA.decode_attention(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1], res[i],
                                        scratch, NH, NH, HD)
            run()
            torch.cuda.synchronize()
            out = res.clone()
            return graph_ms(run, calls=3) * 1e3 / LAYERS, out
        base_us, base = measure(4, 128)
        print(f"b={b}: shipped (4 warps, chunk 128) {base_us:.2f} us/layer "
              f"({kv_bytes / (base_us * 1e-6) / 1e9:.0f} GB/s)", flush=True)
        for warps, chunk in itertools.product(ints(args.warps), ints(args.chunks)):
            if (warps, chunk) == (4, 128):
                continue
            try:
                us, out = measure(warps, chunk)
            except Exception as e:      # noqa: BLE001 - a setting that does not build: say so
                print(f"  warps {warps} chunk {chunk}: {type(e).__name__}: {str(e)[:100]}")
                continue
            diff = (out.float() - base.float()).abs().max().item()
            print(f"  warps {warps} chunk {chunk}: {us:.2f} us/layer "
                  f"({kv_bytes / (us * 1e-6) / 1e9:.0f} GB/s, {base_us / us:.2f}x), "
                  f"max diff {diff:.3g}", flush=True)
        DA.ATTEND_WARPS = 4
        del kv, qkv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
