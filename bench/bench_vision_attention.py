"""The vision encoder's attention, Triton kernel (ops/vision_attention.py) against SDPA (the
encoder's default, cuDNN on the H200) in the same run: [crops, 16 heads, 729, 72] bf16 from
a qkv GEMM output [crops, 729, 3456], one encode's 27 calls as a CUDA graph (median of
replays, bench_timing.graph_ms), per kernel config (BLOCK_M, BLOCK_N, warps, stages), and each
output's max relative difference to SDPA in fp32.

Usage (H200): PYTHONPATH=. python3 bench/bench_vision_attention.py [--crops 9]
                  [--configs 128x64x8x3,64x64x4x3]
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
from photon_core.ops.vision_attention import (TIMED_CONFIGS, vision_attention,  # noqa: E402
                                              vision_attention_reference)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--configs", default=",".join("x".join(map(str, c)) for c in TIMED_CONFIGS))
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
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_vision_attention.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
