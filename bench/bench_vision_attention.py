"""The vision encoder's attention, Triton kernel (ops/vision_attention.py) against SDPA (the
encoder's default, cuDNN on the H200) in the same run: [crops, 16 heads, 729, 72] bf16 from
a qkv GEMM output [crops, 729, 3456], one encode's 27 calls as a CUDA graph (median of
replays, bench_timing.graph_ms), per kernel config (BLOCK_M, BLOCK_N, warps, stages), and each
output's max relative difference to SDPA in fp32.

Usage (H200): PYTHONPATH=. python3 bench/bench_vision_attention.py [--crops 9]
                  [--configs 128x64x8x3,64x64x4x3]   (BMxBNxWARPSxSTAGES[xTMA[xFAST_EXP]])
                  [--prefix-configs 64x64x4x3 --prefix-frames 1,4]
Writes $OUT/bench_vision_attention.json when OUT is set.
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
from photon_core.ops.vision_attention import (TIMED_CONFIGS, prefix_attention,  # noqa: E402
                                              vision_attention, vision_attention_reference)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--configs", default=",".join("x".join(map(str, c)) for c in TIMED_CONFIGS))
    ap.add_argument("--prefix-configs", default="",
                    help="also the image-prefix prefill's attention (ops prefix_attention: "
                         "q [n, 730, 32, 64] token-major, k / v [n, 32, 730, 64]) against SDPA, "
                         "24 calls per graph, these configs")
    ap.add_argument("--prefix-frames", default="1,4")
    args = ap.parse_args()
    heads, t, hd = 16, 729, 72
    g = torch.Generator("cuda").manual_seed(9)
    qkv = torch.randn(args.crops, t, 3 * heads * hd, device="cuda", dtype=torch.bfloat16,
                      generator=g) * 2
    ref32 = vision_attention_reference(qkv.float(), heads)
    scale = ref32.abs().max().item()
    flop = 4 * args.crops * heads * t * t * hd * args.layers

    def rel(o):
        return round((o.float() - ref32).abs().max().item() / scale, 5)

    def row(fn):
        ms = graph_ms(fn, calls=args.layers) * args.layers
        return {"ms_per_encode": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                "rel_diff_vs_fp32": rel(fn())}
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": [args.crops, heads, t, hd], "rows": {}}
    out["rows"]["sdpa"] = row(lambda: vision_attention_reference(qkv, heads))
    print(f"sdpa: {out['rows']['sdpa']}", flush=True)
    for c in args.configs.split(","):
        cfg = tuple(int(x) for x in c.split("x"))
        try:
            out["rows"][c] = r = row(lambda cfg=cfg: vision_attention(qkv, heads, cfg))
            r["vs_sdpa"] = round(out["rows"]["sdpa"]["ms_per_encode"] / r["ms_per_encode"], 3)
        except Exception as e:  # noqa: BLE001
            out["rows"][c] = {"error": repr(e)[:300]}
        print(f"{c}: {out['rows'][c]}", flush=True)
    if args.prefix_configs:
        out["prefix"] = prefix_rows(args)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_vision_attention.json").write_text(
            json.dumps(out, indent=1))


def prefix_rows(args) -> dict:
    """The prefix prefill's attention (Moondream 2: 730 tokens, 32 heads of 64, one layer's
    call x 24 per graph): SDPA as prefix_prefill runs it vs prefix_attention's configs."""
    import torch.nn.functional as F
    rows = {}
    for n in (int(x) for x in args.prefix_frames.split(",")):
        t, nh, hd, layers = 730, 32, 64, 24
        g = torch.Generator("cuda").manual_seed(n)
        q, k, v = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * 2
                   for s in ((n, t, nh, hd), (n, nh, t, hd), (n, nh, t, hd)))
        ref32 = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float(),
                                               v.float()).transpose(1, 2).reshape(n, t, -1)
        scale = ref32.abs().max().item()
        flop = 4 * n * nh * t * t * hd * layers

        def row(fn):
            ms = graph_ms(fn, calls=layers) * layers
            return {"ms_per_encode": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                    "rel_diff_vs_fp32": round((fn().float() - ref32).abs().max().item()
                                              / scale, 5)}
        key = f"frames{n}"
        rows[key] = {"sdpa": row(lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v).transpose(1, 2).reshape(n, t, nh * hd))}
        print(f"prefix {key} sdpa: {rows[key]['sdpa']}", flush=True)
        for c in args.prefix_configs.split(","):
            cfg = tuple(int(x) for x in c.split("x"))
            try:
                rows[key][c] = r = row(lambda cfg=cfg: prefix_attention(q, k, v, cfg))
                r["vs_sdpa"] = round(rows[key]["sdpa"]["ms_per_encode"] / r["ms_per_encode"],
                                     3)
            except Exception as e:  # noqa: BLE001
                rows[key][c] = {"error": repr(e)[:300]}
            print(f"prefix {key} {c}: {rows[key][c]}", flush=True)
    return rows


if __name__ == "__main__":
    main()
