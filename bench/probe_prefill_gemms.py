"""The image-prefix prefill's GEMMs (Moondream 2's text shapes, M = 730 tokens per frame) on
the H200: each alone, the attention branch beside the MLP branch on two streams, and qkv +
fc1 as one joined GEMM (N = 6144 + 8192) with the GELU pass on its fc1 columns after it.

Each figure is a CUDA graph of --calls back-to-back calls (bench_timing.graph_ms), random bf16
operands of the real shapes; the SDPA is the prefill's (32 heads x 64 over the P keys).

Usage (H200): PYTHONPATH=. python3 bench/probe_prefill_gemms.py [--frames 1,4] [--calls 20]
Writes $OUT/probe_prefill_gemms.json when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from photon_core.ops.linear_gelu import linear_gelu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", default="1,4")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    dim, ff, heads, hd, p = 2048, 8192, 32, 64, 730
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    w_qkv, b_qkv, w_fc1, b_fc1 = rnd(3 * dim, dim), rnd(3 * dim), rnd(ff, dim), rnd(ff)
    w_proj, b_proj, w_fc2 = rnd(dim, dim), rnd(dim), rnd(dim, ff)
    w_1, b_1 = torch.cat([w_qkv, w_fc1]), torch.cat([b_qkv, b_fc1])
    side = torch.cuda.Stream()
    out = {"gpu": torch.cuda.get_device_name(), "frames": {}}
    for n in (int(f) for f in args.frames.split(",")):
        m = n * p
        h, a, gl = rnd(m, dim), rnd(m, dim), rnd(m, ff)
        q, k, v = (rnd(n, heads, p, hd) for _ in range(3))
        forms = {
            "qkv": lambda: F.linear(h, w_qkv, b_qkv),
            "fc1_gelu": lambda: linear_gelu(h, w_fc1, b_fc1),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "proj": lambda: F.linear(a, w_proj, b_proj),
            "fc2": lambda: F.linear(gl, w_fc2),
            "proj_addmm_fc2": lambda: F.linear(a, w_proj, b_proj).addmm_(gl, w_fc2.t()),
            "joined_w1": lambda: F.linear(h, w_1, b_1),
            "joined_w1_gelu_pass": lambda: F.gelu(F.linear(h, w_1, b_1)[:, 3 * dim:],
                                                  approximate="tanh"),
        }

        def serial():
            F.linear(h, w_qkv, b_qkv)
            F.scaled_dot_product_attention(q, k, v)
            t = F.linear(a, w_proj, b_proj)
            t.addmm_(linear_gelu(h, w_fc1, b_fc1), w_fc2.t())

        def branches():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                t2 = F.linear(linear_gelu(h, w_fc1, b_fc1), w_fc2)
            F.linear(h, w_qkv, b_qkv)
            F.scaled_dot_product_attention(q, k, v)
            t = F.linear(a, w_proj, b_proj)
            torch.cuda.current_stream().wait_stream(side)
            t.add_(t2)

        forms["block_serial"], forms["block_branches"] = serial, branches
        with torch.inference_mode():
            ms = {name: round(graph_ms(fn, calls=args.calls), 4) for name, fn in forms.items()}
        out["frames"][n] = ms
        print(f"{n} frame(s), M = {m}:", flush=True)
        for name, t in ms.items():
            print(f"    {name:22s} {t * 1e3:9.1f} us", flush=True)
    write_json("probe_prefill_gemms.json", out)


if __name__ == "__main__":
    main()
