"""Which cuBLAS kernel the chunked delta rule's two per-layer products get (Qwen 3.5 0.8B's
640x480 prefix: 305 tokens, 16 heads, chunks of FAST_CHUNK): a = (k beta) k^T and
attn = q k^T over [heads * chunks] batches of [C, 128] x [128, C], fp32. Session 15's encode
profile showed them as sm80 FFMA GEMMs (~60 us each, 36 per encode) even with TF32 allowed.
Times (CUDA graph of 20 calls, us per call) and the kernel names for: the reference form's
operands (views of the padded, transposed tensors), contiguous copies, one product of
[k beta ; q] (M = 2C), TF32 off / on, and bf16 operands.

Usage (H200): PYTHONPATH=. python3 bench/probe_delta_bmm.py [--chunk 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_encode import kernel_times  # noqa: E402


def graph_us(fn, n=20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=305)
    args = ap.parse_args()
    c, t, h, d = args.chunk, args.tokens, 16, 128
    n = -(-t // c)
    dev = "cuda"
    # the reference form's operands: [B, H, T, D] fp32 from transposed [B, T, H, D], padded
    k = F.pad(torch.randn(1, t, h, d, device=dev).transpose(1, 2).float(), (0, 0, 0, n * c - t))
    q = F.pad(torch.randn(1, t, h, d, device=dev).transpose(1, 2).float(), (0, 0, 0, n * c - t))
    beta = torch.rand(1, h, n * c, device=dev)
    kc, qc = k.reshape(1, h, n, c, d), q.reshape(1, h, n, c, d)
    kb = kc * beta.reshape(1, h, n, c)[..., None]
    forms = {
        "reference views": lambda: (kb @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2)),
        "contiguous k^T": lambda: (kb @ kc.transpose(-1, -2).contiguous(),
                                   qc @ kc.transpose(-1, -2).contiguous()),
        "one product [kb; q]": lambda: torch.cat([kb, qc], -2) @ kc.transpose(-1, -2),
        "bf16 operands": lambda: ((kb.bfloat16() @ kc.bfloat16().transpose(-1, -2)).float(),
                                  (qc.bfloat16() @ kc.bfloat16().transpose(-1, -2)).float()),
    }
    exact = [x.double() for x in forms["reference views"]()]
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for name, fn in forms.items():
            us = graph_us(fn)
            out = fn()
            out = out if isinstance(out, tuple) else (out[..., :c, :], out[..., c:, :])
            err = max(((o.double() - e).abs().max() / e.abs().max()).item()
                      for o, e in zip(out, exact))
            kern = [r[0][:70] for r in kernel_times(fn) if "gemm" in r[0].lower()
                    or "xmma" in r[0] or "cutlass" in r[0] or "nvjet" in r[0]]
            print(f"tf32={tf32!s:5} {name:22s} {us:8.1f} us  rel err {err:.1e}  {kern}",
                  flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    solves(kc, kb, beta, n, c, h, d)


def solves(kc, kb, beta, n, c, h, d):
    """The unit lower-triangular solve (I + A) [u | w] = [beta v | beta k e^cum] of each
    chunk: cuBLAS's batched trsm runs its blocked updates as FFMA GEMMs (TF32 does not apply):
    two solves (the reference form), one solve of both right-hand sides (the fast form's),
    and the inverse from a solve against I followed by one TF32 product."""
    dev = kc.device
    kc = F.normalize(kc, dim=-1)                # the rule's keys are L2-normalised
    kb = kc * beta.reshape(1, h, n, c)[..., None]
    g = -torch.rand(1, h, n, c, device=dev) * 0.1
    cum = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=dev).tril(-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, 0).exp()
    a = ((kb @ kc.transpose(-1, -2)) * decay).masked_fill(~lower, 0) + torch.eye(c, device=dev)
    vb = torch.randn(1, h, n, c, d, device=dev) * beta.reshape(1, h, n, c)[..., None]
    kw = kb * cum.exp()[..., None]
    rhs = torch.cat([vb, kw], -1)
    eye = torch.eye(c, device=dev).expand(1, h, n, c, c)
    st = torch.linalg.solve_triangular
    forms = {
        "two solves": lambda: torch.cat([st(a, vb, upper=False, unitriangular=True),
                                         st(a, kw, upper=False, unitriangular=True)], -1),
        "one solve [v|w]": lambda: st(a, rhs, upper=False, unitriangular=True),
        "solve I, then T @ rhs": lambda: st(a, eye, upper=False, unitriangular=True) @ rhs,
    }
    exact = st(a.double(), rhs.double(), upper=False, unitriangular=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    for name, fn in forms.items():
        us = graph_us(fn)
        err = ((fn().double() - exact).abs().max() / exact.abs().max()).item()
        kern = [f"{r[0][:50]} {r[1] * 1e3:.1f}us x{r[2]}" for r in kernel_times(fn)]
        print(f"solve {name:22s} {us:8.1f} us  rel err {err:.1e}  {kern}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main()
