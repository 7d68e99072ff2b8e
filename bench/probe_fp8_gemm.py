"""Would FP8 GEMMs make the vision encoder faster? The four GEMMs of one SigLIP block at a
640x480 frame's 9 crops (M = 9 x 729 = 6561), bf16 cuBLAS (the current form: F.linear, fc1
with the GELU epilogue) against torch._scaled_mm in float8 e4m3 with row-wise scales
(weights per output channel, quantized once; activations per row, quantized per call),
counting the activation quantization (torch ops, or one Triton pass) in the FP8 time.
Each form: a CUDA graph of 20 calls, median of 7 replays; relative error of each against
the fp32 product of the same bf16 inputs.

Usage (H100 / H200): PYTHONPATH=. python3 bench/probe_fp8_gemm.py [--m 6561]
Writes $OUT/probe_fp8_gemm.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_timing import graph_ms as timed

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _rowwise_fp8(x_ptr, y_ptr, s_ptr, K, GELU: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < K
    x = tl.load(x_ptr + r * K + o, mask=m, other=0.0).to(tl.float32)
    if GELU:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))
    s = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
    tl.store(s_ptr + r, s)
    tl.store(y_ptr + r * K + o, (x / s).to(y_ptr.dtype.element_ty), mask=m)


def quant_triton(x, gelu=False):
    M, K = x.shape
    y = torch.empty(M, K, device=x.device, dtype=FP8)
    s = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    _rowwise_fp8[(M,)](x, y, s, K, GELU=gelu, BLOCK=triton.next_power_of_2(K),
                       num_warps=8 if K > 2048 else 4)
    return y, s


def quant_torch(x, gelu=False):
    if gelu:
        x = F.gelu(x, approximate="tanh")
    s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x / s).to(FP8), s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=6561)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    M, D, FF = args.m, 1152, 4304
    shapes = {"qkv": (D, 3 * D, False), "proj": (D, D, False), "fc1_gelu": (D, FF, True),
              "fc2": (FF, D, False)}
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M}
    tot = {}
    for name, (K, N, gelu) in shapes.items():
        x = torch.randn(M, K, device=dev, dtype=bf)
        if name == "fc2":     # the GELU output: mostly small, a few large
            x = F.gelu(x * 2, approximate="tanh").to(bf)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(bf)
        b = (torch.randn(N, device=dev) * 0.02).to(bf)
        ref = F.linear(x.float(), w.float(), b.float())
        if gelu:
            ref = F.gelu(ref, approximate="tanh")
        sw = (w.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX)
        wq = (w.float() / sw).to(FP8)
        swt = sw.t().contiguous()                     # [1, N]
        wqt = wq.t()                                  # [K, N] column-major

        def bf16():
            if gelu:
                return torch._addmm_activation(b, x, w.t(), use_gelu=True)
            return F.linear(x, w, b)

        def fp8(q, fast, act=gelu, qgelu=False):
            def f():
                xq, sx = q(x, qgelu)
                y = torch._scaled_mm(xq, wqt, scale_a=sx, scale_b=swt, bias=b, out_dtype=bf,
                                     use_fast_accum=fast)
                return F.gelu(y, approximate="tanh") if act else y
            return f

        forms = {"bf16": bf16, "fp8_triton_quant": fp8(quant_triton, False),
                 "fp8_triton_quant_fast_accum": fp8(quant_triton, True),
                 "fp8_torch_quant": fp8(quant_torch, False)}
        # the fused design: fc1 without its GELU, fc2's activation quantization applies it
        if gelu:
            forms["fp8_gelu_moved_to_next_quant"] = fp8(quant_triton, False, act=False)
        if name == "fc2":
            forms["fp8_quant_applies_gelu"] = fp8(quant_triton, False, qgelu=True)
        row = {}
        for k, f in forms.items():
            try:
                y = f().float()
                if k in ("fp8_gelu_moved_to_next_quant", "fp8_quant_applies_gelu"):
                    err = float("nan")    # another function: timing only
                    row[k] = {"ms": round(timed(f), 4), "rel_err": err}
                    continue
                err = float((y - ref).norm() / ref.norm())
                row[k] = {"ms": round(timed(f), 4), "rel_err": err}
            except Exception as e:  # noqa: BLE001
                row[k] = {"error": repr(e)[:300]}
        # the GEMM alone (activations already quantized): the upper bound of the gain
        xq, sx = quant_triton(x)
        row["fp8_gemm_only"] = {"ms": round(timed(lambda: torch._scaled_mm(
            xq, wqt, scale_a=sx, scale_b=swt, bias=b, out_dtype=bf, use_fast_accum=True)), 4)}
        row["triton_quant_only"] = {"ms": round(timed(lambda: quant_triton(x, gelu)), 4)}
        out[name] = row
        for k, v in row.items():
            tot[k] = tot.get(k, 0.0) + v.get("ms", float("nan"))
        print(name, json.dumps(row), flush=True)
    out["block_total_ms"] = {k: round(v, 4) for k, v in tot.items()}
    print("one block:", out["block_total_ms"], "x 27 layers:",
          {k: round(v * 27, 2) for k, v in tot.items()})
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_fp8_gemm.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
