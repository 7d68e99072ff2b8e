"""The GEMV's weight tiles by Hopper's bulk tensor copies (gemv.TMA) and its split-K residual
sums by relaxed atomics (gemv.RELAXED_ATOMICS), each against its absence, on the decode
GEMVs' shapes (Moondream 2's and its region heads'), bf16, weights rotating over copies so
L2 never holds them (sweep_gemv.py's timing), with gemv.pick's config; then, with both on,
the fastest of a few tiles the copy engine takes (each side <= 256), so a table entry can
follow. Every output diffed against fp32 torch.

Usage: PYTHONPATH=. python3 bench/probe_tma_gemv.py [--batches 1,2,4,8] [--top 3]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_kernels import graph_ms  # noqa: E402
from bench.bench_timing import copy_bandwidth  # noqa: E402
from photon_core.ops import gemv as G  # noqa: E402

SHAPES = {"qkv|fc1 +gelu": (14336, 2048, G.EPI_QKV_GELU),
          "proj|fc2 +res": (2048, 10240, G.EPI_RESIDUAL),
          "lm head": (51200, 2048, G.EPI_STORE),
          "region fc1 +gelu": (8192, 2048, G.EPI_QKV_GELU),
          "size fc2": (2048, 8192, G.EPI_STORE)}
FORMS = {"pointer, acq_rel": ("off", False), "pointer, relaxed": ("off", True),
         "tma, acq_rel": ("on", False), "tma, relaxed": ("on", True)}


def tiles(b, n, k, epi):
    """A few tiles the copy engine takes (GemvConfig, fitting the shape)."""
    dot = b > 1
    out = []
    for bn, bk, stages, sk in itertools.product(
            (16, 32, 64, 128) if dot else (4, 8, 16), (128, 256), (3, 5),
            (1, 2, 4) if epi == G.EPI_RESIDUAL else (1,)):
        c = G.GemvConfig(bn, bk, sk, 8 if bn == 128 else 4, stages, dot)
        if c.fits(b, n, k, epi) and -(-n // bn) * sk >= 132:
            out.append(c)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    dev, dt = "cuda", torch.bfloat16
    keep = G.TMA, G.RELAXED_ATOMICS
    for name in args.shapes.split(","):
        n, k, epi = SHAPES[name]
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device=dev, dtype=torch.float32 if epi == G.EPI_RESIDUAL else dt)
        split, gap = (6144, 0) if n == 14336 else (0, 0)
        for b in (int(v) for v in args.batches.split(",")):
            x = torch.randn(b, k, device=dev, dtype=dt)
            floor = n * k * 2 / bw * 1e6
            y = torch.zeros(b, n, device=dev, dtype=torch.float32 if epi == G.EPI_RESIDUAL
                            else dt)
            ref = torch.zeros_like(y)
            G.gemv_reference(x, ws[0], bias, ref, epi, n_split=split, gap=gap)

            def timed(cfg):
                y.zero_()
                G.gemv(x, ws[0], bias, y, epi, n_split=split, gap=gap, cfg=cfg)
                torch.cuda.synchronize()
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = graph_ms(lambda: [G.gemv(x, w, bias, y, epi, n_split=split, gap=gap,
                                              cfg=cfg) for w in ws]) / copies * 1e3
                return us, err
            pcfg = G.pick(b, n, k, epi)
            print(f"{name} n={n} k={k} b={b}: floor {floor:.2f} us; gemv.pick {pcfg}")
            for form, (tma, relaxed) in FORMS.items():
                if relaxed and epi != G.EPI_RESIDUAL:
                    continue
                G.TMA, G.RELAXED_ATOMICS = tma, relaxed
                used = G.tma_weights(ws[0], pcfg) is not None
                us, err = timed(pcfg)
                print(f"   {form:18s} {us:7.2f} us ({floor / us * 100:3.0f} %)"
                      f"{'' if used or tma == 'off' else ' (tile too wide: pointer loads)'}"
                      f" err {err:.1e}")
            G.TMA, G.RELAXED_ATOMICS = "on", True
            rows = []
            for cfg in tiles(b, n, k, epi):
                try:
                    rows.append((*timed(cfg), cfg))
                except Exception as e:  # noqa: BLE001
                    rows.append((float("inf"), repr(e)[:100], cfg))
            rows.sort(key=lambda r: r[0])
            for us, err, cfg in rows[:args.top]:
                print(f"   tma tile {cfg}: {us:.2f} us ({floor / us * 100:.0f} %) err {err}")
            G.TMA, G.RELAXED_ATOMICS = keep
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
