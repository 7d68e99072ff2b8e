"""Does the vision encoder's attention get faster with its head size padded? SigLIP's heads
are 72 wide, which the SDPA kernels may run as 128-wide tiles. Time
F.scaled_dot_product_attention on [crops, 16 heads, 729, d] bf16 for d in 64..128 under each
SDPA backend (cuDNN, flash, efficient), as CUDA graphs of 27 calls (one encode's layers),
median of 7 replays; plus the zero-padded form (q / k / v of width 72 padded to d: the same
result in the first 72 columns of the output, checked here) to see what padding the qkv
GEMM's weights (zero rows) would buy. 9 crops = a 640x480 frame.

Usage (H200): PYTHONPATH=. python3 bench/probe_vision_attention_pad.py [--crops 9]
Writes $OUT/probe_vision_attention_pad.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_timing import graph_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args()
    torch.manual_seed(0)
    n, h, t = args.crops, 16, 729
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [n, h, t]}
    base = [torch.randn(n, h, t, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ref = F.scaled_dot_product_attention(*[x.float() for x in base])
    for d in (64, 72, 80, 96, 128):
        if d >= 72:          # zero-padded: the same attention in the first 72 columns
            q, k, v = [F.pad(x, (0, d - 72)) for x in base]
        else:
            q, k, v = [x[..., :d].contiguous() for x in base]
        row = {}
        for name, be in BACKENDS.items():
            try:
                with sdpa_kernel([be]):
                    y = F.scaled_dot_product_attention(q, k, v)
                    ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v),
                                  calls=args.layers)
                r = {"ms_per_encode": round(ms * args.layers, 4)}
                if d >= 72:
                    # padding changes the softmax scale (1/sqrt(d)): pass the 72-wide scale
                    with sdpa_kernel([be]):
                        ys = F.scaled_dot_product_attention(q, k, v, scale=72 ** -0.5)
                    r["max_abs_diff_vs_fp32_72"] = float((ys[..., :72].float() - ref).abs().max())
                    with sdpa_kernel([be]):
                        ms2 = graph_ms(lambda: F.scaled_dot_product_attention(
                            q, k, v, scale=72 ** -0.5), calls=args.layers)
                    r["ms_per_encode_scale72"] = round(ms2 * args.layers, 4)
                del y
                row[name] = r
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": repr(e)[:200]}
        out[f"d{d}"] = row
        print(f"d={d}: " + json.dumps(row), flush=True)
    # what the padding costs the GEMMs around attention (qkv: 3 x 16 x d outputs; proj: K =
    # 16 x d), per encode (x layers), M = crops x 729
    m = n * t
    x = torch.randn(m, 1152, device="cuda", dtype=torch.bfloat16)
    for d in (72, 80, 96):
        wq = torch.randn(3 * h * d, 1152, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(m, h * d, device="cuda", dtype=torch.bfloat16)
        wp = torch.randn(1152, h * d, device="cuda", dtype=torch.bfloat16)
        out[f"gemms_d{d}"] = {
            "qkv_ms_per_encode": round(graph_ms(lambda: F.linear(x, wq)) * args.layers, 4),
            "proj_ms_per_encode": round(graph_ms(lambda: F.linear(a, wp)) * args.layers, 4)}
        print(f"GEMMs d={d}: {out[f'gemms_d{d}']}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_vision_attention_pad.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
