"""Where the fast encode's time goes now, and what the parts could reach (issue 13), on the GPU.

Real Moondream 2 shapes, random bf16 weights, one process, every figure against a baseline of
the same run:
  - kernel time by kind (GEMM / attention / norm / elementwise / other) of the runtime's
    vision encoder (vision_fused.encoder, 9 crops) and image-prefix prefill
    (prefill_prefix fast=True, 730 tokens, 1 and 4 frames), from the profiler;
  - vision attention at [9, 16, 729, 72]: SDPA per backend with the head size as it is and
    zero-padded to 80 / 96 / 128 (same result: padded q/k add 0 to every score, padded v
    columns are sliced off; the scale stays 1/sqrt(72));
  - bf16 GEMM rates (TFLOP/s) of the vision shapes (M = 6561) and the prefill shapes
    (M = 730 and 2920), F.linear with bias;
  - torch.compile of vision_fused.encoder's math (default mode): compile seconds and the
    graph-replayed time, against the same encoder as a CUDA graph (what a compiler would buy).

Usage: PYTHONPATH=. python3 bench/probe_encode.py [--iters 10] [--no-compile]
Writes $OUT/probe_encode.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cuda_ms, say  # noqa: E402
from bench.bench_kernels import graph_ms  # noqa: E402
from photon_core.models.moondream2 import batched_encode, vision_fused  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402

KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "_mm_")),
         ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
         ("norm", ("layer_norm", "layernorm", "_add_ln", "norm")),
         ("elementwise", ("elementwise", "vectorized", "gelu", "copy", "cat", "index",
                          "rope", "rotary")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_kinds(fn, top=6):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    by_kind: dict[str, float] = {}
    for e in evs:
        k = kind_of(e.key)
        by_kind[k] = by_kind.get(k, 0.0) + e.self_device_time_total / 1e3
    evs.sort(key=lambda e: -e.self_device_time_total)
    return {"total_ms": round(sum(by_kind.values()), 3),
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "launches": sum(e.count for e in evs),
            "top": [(e.key[:80], round(e.self_device_time_total / 1e3, 3), e.count)
                    for e in evs[:top]]}


def section(out, name, fn):
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001
        out[name] = {"error": repr(e), "tb": traceback.format_exc()[-1500:]}
    say(f"{name}: {json.dumps(out[name])}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    it = args.iters
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "date": time.strftime("%Y-%m-%d")}
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    v, w, t = m.config.vision, m.weights, m.config.text
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    with torch.inference_mode():
        _, x, _ = m.image_crops(frame)
        out["crops"] = int(x.shape[0])

        def vis():
            return vision_fused.encoder(w, v, x)

        section(out, "vision_graph_ms", lambda: round(graph_ms(vis, it), 3))
        section(out, "vision_profile", lambda: profile_kinds(vis))
        for n in (1, 4):
            pre = torch.randn(n, m.prefix_len, t.dim, device="cuda", dtype=w.dtype)
            kv = batched_encode.kv_buffer(m, n)

            def pf(pre=pre, kv=kv):
                return prefill_prefix(w, t, pre, kv, m.prefix_len, fast=True)
            section(out, f"prefill_n{n}_graph_ms", lambda: round(graph_ms(pf, it), 3))
            section(out, f"prefill_n{n}_profile", lambda: profile_kinds(pf))

        def sdpa_pad():
            res = {}
            n, h, s, d = x.shape[0], v.enc_n_heads, 729, v.enc_dim // v.enc_n_heads
            q, k, vv = (torch.randn(n, h, s, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3))
            ref = F.scaled_dot_product_attention(q, k, vv)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for pad in (d, 80, 96, 128):
                qp, kp, vp = (F.pad(z, (0, pad - d)) for z in (q, k, vv))
                for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        with sdpa_kernel(getattr(SDPBackend, be)):
                            def f():
                                return F.scaled_dot_product_attention(
                                    qp, kp, vp, scale=d ** -0.5)[..., :d]
                            diff = (f().float() - ref.float()).abs().max().item()
                            res[f"d{pad}_{be[:5].lower()}"] = {
                                "ms_27_layers": round(cuda_ms(f, it) * v.enc_n_layers, 3),
                                "max_diff": round(diff, 4)}
                    except Exception as e:  # noqa: BLE001
                        res[f"d{pad}_{be[:5].lower()}"] = repr(e)[:100]
            return res
        section(out, "vision_sdpa_padded", sdpa_pad)

        def gemms():
            res = {}
            shapes = {"vision": (x.shape[0] * 729, [(1152, 3456), (1152, 1152), (1152, 4304),
                                                    (4304, 1152)]),
                      "prefill_730": (730, [(2048, 6144), (2048, 2048), (2048, 8192),
                                            (8192, 2048)]),
                      "prefill_2920": (2920, [(2048, 6144), (2048, 2048), (2048, 8192),
                                              (8192, 2048)])}
            for label, (mrows, kn) in shapes.items():
                for kdim, ndim in kn:
                    a = torch.randn(mrows, kdim, device="cuda", dtype=torch.bfloat16)
                    wt = torch.randn(ndim, kdim, device="cuda", dtype=torch.bfloat16)
                    b = torch.randn(ndim, device="cuda", dtype=torch.bfloat16)
                    ms = cuda_ms(lambda: F.linear(a, wt, b), it)
                    res[f"{label}_{kdim}x{ndim}"] = {
                        "ms": round(ms, 4), "tflops": round(2 * mrows * kdim * ndim / ms / 1e9, 1)}
            return res
        section(out, "gemm_rates", gemms)

        if not args.no_compile:
            def compiled():
                t0 = time.perf_counter()
                cf = torch.compile(vision_fused.encoder)
                y = cf(w, v, x, fuse_norms=False)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                ref = vis()
                rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                return {"compile_s": round(secs, 1),
                        "compiled_graph_ms": round(graph_ms(
                            lambda: cf(w, v, x, fuse_norms=False), it), 3),
                        "eager_graph_ms": round(graph_ms(vis, it), 3),
                        "rel_diff": round(rel, 5)}
            section(out, "vision_torch_compile", compiled)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_encode.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
