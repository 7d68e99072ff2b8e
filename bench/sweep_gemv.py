"""GEMV config sweep for the shapes bench_kernels.py does not sweep: the residual GEMV
without split-K (deterministic=True) and the region heads (detect/point), real Moondream 2
shapes, bf16, batch 1 and 8 (--batches), and with --shapes decode the decode step's three
GEMVs too. Weight copies rotate so L2 never holds them; CUDA-graph timing
(bench_kernels.graph_ms); every config's output diffed against gemv.gemv_reference (fp32
sums, the epilogue's rounding). The split-K
residual config in gemv.TABLE, and gemv.pick's config for the batch, are timed in the same run
as baselines. The fma form (one row) is swept at b = 1 (split-K fma for the residual GEMV
too).

Usage: PYTHONPATH=. python3 bench/sweep_gemv.py [--batches 1,8] [--shapes all|decode|heads]
           [--configs BN:BK:SPLIT:WARPS:STAGES:f|d,...]   (only these, with TABLE's and pick's)
           [--show 6]
(prints the best configs per shape/batch)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import copy_bandwidth  # noqa: E402
from bench.bench_kernels import graph_ms  # noqa: E402

from photon_core.ops import gemv as G  # noqa: E402

C = G.GemvConfig
FMA = [C(8, 512, 1, 4, 3, False), C(16, 512, 1, 4, 3, False), C(16, 256, 1, 4, 3, False),
       C(16, 512, 1, 8, 3, False), C(32, 256, 1, 8, 3, False), C(16, 1024, 1, 8, 3, False),
       C(8, 1024, 1, 4, 3, False), C(4, 1024, 1, 4, 3, False), C(8, 256, 1, 4, 4, False),
       C(4, 512, 1, 4, 3, False), C(8, 512, 4, 4, 3, False), C(8, 512, 2, 4, 3, False),
       C(16, 256, 4, 4, 3, False), C(4, 1024, 2, 4, 3, False),
       # two rows per program (gemv._rule's b = 1 form below N = 8192; session 30)
       C(2, 1024, 1, 4, 3, False), C(2, 512, 1, 4, 3, False), C(2, 1024, 1, 2, 3, False),
       C(2, 2048, 1, 8, 3, False), C(4, 2048, 1, 8, 3, False)]
DOT = [C(16, 256, 1, 4, 3, True), C(32, 128, 1, 4, 4, True), C(16, 512, 1, 4, 3, True),
       C(32, 256, 1, 4, 3, True), C(64, 128, 1, 4, 3, True), C(16, 128, 1, 4, 4, True),
       # more for the prompt prefill's rows (b = 8; session 30)
       C(128, 128, 1, 8, 3, True), C(64, 256, 1, 8, 3, True), C(32, 512, 1, 8, 3, True),
       C(64, 128, 1, 4, 4, True), C(16, 256, 2, 4, 3, True), C(16, 512, 2, 4, 3, True),
       C(32, 256, 2, 4, 3, True), C(16, 256, 4, 4, 4, True), C(32, 128, 4, 4, 4, True),
       C(16, 1024, 1, 8, 3, True), C(32, 256, 1, 8, 4, True)]
DECODE = {   # the decode step's GEMVs (bench_kernels.py sweeps them at its candidates)
    "qkv|fc1 +gelu": (14336, 2048, G.EPI_QKV_GELU),
    "lm head": (51200, 2048, G.EPI_STORE),
}
SHAPES = {   # name: (n, k, epi)
    "proj|fc2 +res": (2048, 10240, G.EPI_RESIDUAL),
    "region fc1 +gelu": (8192, 2048, G.EPI_QKV_GELU),
    "coord fc2": (1024, 8192, G.EPI_STORE),
    "size fc2": (2048, 8192, G.EPI_STORE),
}


def sweep_shape(out: dict, name: str, n: int, k: int, epi: int, batches, bw: float,
                extra=(), deterministic: bool = False, show: int = 6,
                only: list | None = None) -> dict:
    """Time every fitting candidate (FMA at b = 1, DOT, `extra` - or `only` - and gemv.TABLE's
    and gemv.pick's configs, deterministic mode's too) for one shape at each batch size;
    out[f"{name} b={b}"] = {floor_us, table, pick, rows: [(us, config, rel err)] fastest
    first}. Returns out."""
    dev, dt = "cuda", torch.bfloat16
    wbytes = n * k * 2
    copies = max(2, -(-400_000_000 // wbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, device=dev, dtype=torch.float32 if epi == G.EPI_RESIDUAL else dt)
    for b in batches:
        x = torch.randn(b, k, device=dev, dtype=dt)
        mul = torch.randn(b, n, device=dev, dtype=dt) if epi == G.EPI_ACT_MUL else None
        width = n // 2 if epi == G.EPI_GATED else n       # (gated: act(gate) * up per pair)
        ydt = torch.float32 if epi == G.EPI_RESIDUAL else dt
        want = G.gemv_reference(x, ws[0], bias, torch.zeros(b, width, device=dev, dtype=ydt),
                                epi, mul=mul).float()
        pool = only if only is not None else (FMA if b == 1 else []) + DOT + list(extra)
        cands = [c for c in pool
                 if c.fits(b, n, k, epi) and not (deterministic and c.split_k > 1)]
        table = G.TABLE.get((n, k, epi, b == 1))
        picked = G.pick(b, n, k, epi, deterministic)
        for c in (table, picked, G.pick(b, n, k, epi, deterministic=True)):
            if c is not None and c not in cands:
                cands.append(c)
        rows = []
        for cfg in dict.fromkeys(cands):
            y = torch.zeros(b, width, device=dev, dtype=ydt)
            try:
                G.gemv(x, ws[0], bias, y, epi, cfg=cfg, mul=mul)
                torch.cuda.synchronize()
                err = ((y.float() - want).abs().max() / want.abs().max()).item()
                us = graph_ms(lambda: [G.gemv(x, w, bias, y, epi, cfg=cfg, mul=mul)
                                       for w in ws]) / copies * 1e3
                rows.append((us, str(cfg), err))
            except Exception as e:  # noqa: BLE001
                rows.append((float("inf"), str(cfg), repr(e)[:100]))
        rows.sort()
        floor = wbytes / bw * 1e6
        out[f"{name} b={b}"] = {"n": n, "k": k, "epi": epi, "b": b, "floor_us": floor,
                                "table": str(table), "pick": str(picked), "rows": rows}
        print(f"\n{name} n={n} k={k} epi={epi} b={b}: floor {floor:.1f} us; TABLE {table}")
        for us, c, err in rows[:show]:
            print(f"  {us:7.2f} us ({floor / us * 100:4.0f}%)  {c}  err {err}")
        for what, cfg in (("TABLE", table), ("pick", picked)):
            if cfg is not None:
                t = [r for r in rows if r[1] == str(cfg)]
                print(f"  {what} config: {t[0][0]:.2f} us" if t else f"  {what}: n/a")
    ws.clear()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default="heads", choices=("heads", "decode", "all"))
    ap.add_argument("--configs", default="",
                    help="BN:BK:SPLIT:WARPS:STAGES:f|d,... (f: FMA, d: tensor-core dot): "
                         "sweep only these")
    ap.add_argument("--show", type=int, default=6)
    args = ap.parse_args()
    only = None
    if args.configs:
        only = []
        for spec in args.configs.split(","):
            *nums, form = spec.split(":")
            only.append(C(*(int(v) for v in nums), form == "d"))
    shapes = {**(DECODE if args.shapes in ("decode", "all") else {}),
              **({k: v for k, v in SHAPES.items() if args.shapes != "decode"
                  or k == "proj|fc2 +res"})}
    bw = copy_bandwidth()
    out = {"copy_bw_TBps": bw / 1e12}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name, (n, k, epi) in shapes.items():
        sweep_shape(out, name, n, k, epi, [int(v) for v in args.batches.split(",")], bw,
                    show=args.show, only=only)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sweep_gemv.json").write_text(json.dumps(out, indent=1,
                                                                         default=str))


if __name__ == "__main__":
    main()
