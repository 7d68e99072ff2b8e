"""Every equivalent way to compute the encode's big-M GEMMs, timed in CUDA graphs (issue 13).

The vision tower (M = 9 crops x 729 = 6561 rows) and the image-prefix prefill (M = 730, and
2920 for 4 frames) of Moondream 2 run bf16 GEMMs with a bias (fc1 with a tanh-GELU epilogue)
whose cuBLAS rates differ a lot (session 5: qkv / proj ~615, fc1 ~640, fc2 ~818 TFLOP/s).
For each shape (real sizes, random weights, bf16) this times, as CUDA graphs of --calls
back-to-back calls (median of --replays replays), each form that computes the same output:

  current      what the runtime does (F.linear; fc1: torch._addmm_activation(b, x, W^T,
               use_gelu=True), ops/linear_gelu.py); "rot4W": the same over 4 copies of the
               weights in turn (the graph's calls read different weights: less L2 reuse,
               as the encode's layers; every other form reuses one weight tensor)
  linear3d     F.linear on the [crops, 729, K] view (vision only)
  addmm        torch.addmm(b, x, W.t())
  mm+bias      x @ W.t() then + b (two kernels)            | linear+gelu: fc1 GEMM, then GELU
  Wt           weights stored pre-transposed [K, N]: addmm(b, x, Wt) (fc1: the epilogue form)
  outT         the transposed product W @ x^T + b[:, None] = out^T [N, M]; "+T" adds the
               copy back to [M, N] (what using it costs when the consumer needs [M, N])
  splitN<k>    k GEMMs over N slices of W (separate outputs: the consumer takes the pieces);
               "+cat" adds torch.cat into one [M, N]
  splitM<k>    k GEMMs over row chunks, each written into its rows of one output (out=)
  padM<p>      M padded to a multiple of p (the input already in a padded buffer: GEMM only)
  padN / padK  N / K padded to a multiple of 128 with zero weight rows / columns (vision
               ff 4304 -> 4352: fc1's extra outputs are gelu(0) = 0, fc2's extra K adds 0)
  set:<s>      the current call captured under a torch.backends.cuda.matmul setting
               (allow_bf16_reduced_precision_reduction flipped; preferred_blas_library
               cublaslt / cublas)
  triton<cfg>  a tiled tl.dot kernel (grouped tile order, bias / GELU in the epilogue), one
               row per block config
  tma<cfg>     a persistent TMA kernel (host TensorDescriptor), one row per config
Pairs (prefill): the parallel block's proj + fc2 (current: F.linear + addmm_ beta=1, as
prefix_prefill._prefill_fused) vs one GEMM over the concatenated K [attn | gelu] (K = 10240),
and qkv + fc1 (same input) as one GEMM over N = 14336 with GELU on the fc1 columns only.

Per form: ms per call, TFLOP/s, the ratio to the current form's time, max abs / rel
difference to the current form's output and whether it is bitwise equal, and the max abs
error of both against an fp32 reference (so a form that differs can be judged).
Every form is guarded: one that fails prints why and the rest run.

Usage (GPU, one command, < 4 min on an H200):
    PYTHONPATH=. python3 bench/probe_gemm_forms.py [--calls 20] [--replays 7] [--only vis]
        [--no-triton] [--budget-s 200]   (forms not started within the budget are skipped)
Prints a markdown table per shape and a JSON line; writes $OUT/probe_gemm_forms.json.
    python3 bench/probe_gemm_forms.py --smoke      # CPU, tiny sizes, fp32, no timings,
                                                   # Triton under TRITON_INTERPRET=1
    python3 bench/probe_gemm_forms.py --compile    # no GPU: compile the Triton kernels for
                                                   # sm_90 (registers / spills / shared)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
elif "--compile" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_timing import graph_ms  # noqa: E402

from photon_core.megakernel.megakernel_step import sm_count  # noqa: E402

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

# --------------------------------------------------------------------------------- Triton

if HAVE_TRITON:
    @triton.jit
    def _tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))          # no overflow anywhere
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _epilogue(acc, b_ptr, rn, N, gelu_from, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
        """fp32 acc [BM, BN] + bias, then tanh-GELU on the columns >= gelu_from (GELU)."""
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        if GELU:
            g = 0.5 * acc * (1.0 + _tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
            acc = tl.where(rn[None, :] >= gelu_from, g, acc)
        return acc

    @triton.jit
    def _tile_of(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped tile order: GROUP_M row tiles sweep the N tiles together (L2 reuse)."""
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        group = GROUP_M * num_n
        first_m = (tile // group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % gsize
        pid_n = (tile % group) // gsize
        return pid_m, pid_n

    @triton.jit
    def gemm_bias_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, gelu_from,
                         HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EVEN_K: tl.constexpr,
                         IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr):
        """y[M, N] = epilogue(x[M, K] @ w[N, K]^T): one [BM, BN] tile per program."""
        pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        am = rm % M                                    # clamped rows / columns: no load masks
        bn = rn % N
        x_ptrs = x_ptr + am[:, None] * sxm + rk[None, :]
        w_ptrs = w_ptr + bn[None, :] * swn + rk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K // BK):          # full K tiles: no masks (the loop pipelines)
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            x_ptrs += BK
            w_ptrs += BK
        if not EVEN_K:
            # the K % BK tail (vision fc2: K = 4304 = 67 x 64 + 16) in 16-wide masked steps:
            # a BK-wide masked tile beside the live accumulator spilled (Triton 3.6, sm_90)
            rt = tl.arange(0, 16)
            for kt in range(K // BK * BK, K, 16):
                kk = kt + rt
                a = tl.load(x_ptr + am[:, None] * sxm + kk[None, :], mask=kk[None, :] < K,
                            other=0.0)
                b = tl.load(w_ptr + bn[None, :] * swn + kk[:, None], mask=kk[:, None] < K,
                            other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
        acc = _epilogue(acc, b_ptr, rn, N, gelu_from, HAS_BIAS, GELU)
        y_ptrs = y_ptr + rm[:, None] * sym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def gemm_bias_tma_kernel(x_desc, w_desc, b_ptr, y_desc, M, N, K, gelu_from, num_progs,
                             HAS_BIAS: tl.constexpr, GELU: tl.constexpr, IEEE: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, GROUP_M: tl.constexpr):
        """Persistent: num_progs programs stride over the tiles; TMA loads / store (the
        descriptors zero-fill out-of-range reads and clip the store)."""
        num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        for tile in tl.range(tl.program_id(0), num_tiles, num_progs):
            pid_m, pid_n = _tile_of(tile, M, N, BM, BN, GROUP_M)
            om = pid_m * BM
            on = pid_n * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(k_tiles):
                a = x_desc.load([om, k * BK])
                b = w_desc.load([on, k * BK])
                if IEEE:
                    acc = tl.dot(a, b.T, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b.T, acc)
            rn = on + tl.arange(0, BN)
            acc = _epilogue(acc, b_ptr, rn, N, gelu_from, HAS_BIAS, GELU)
            y_desc.store([om, on], acc.to(b_ptr.dtype.element_ty))   # bias dtype = output's

# block configs: (BM, BN, BK, GROUP_M, num_warps, num_stages)
TILED_CONFIGS = ((128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3),
                 (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 4, 4))
TMA_CONFIGS = ((128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3),
               (128, 128, 64, 8, 8, 5))
SMOKE_CONFIGS = ((16, 16, 16, 2, 4, 1), (32, 16, 16, 1, 4, 1))


def _cfg_name(c) -> str:
    return f"{c[0]}x{c[1]}x{c[2]}/g{c[3]}/w{c[4]}/s{c[5]}"


def triton_gemm(x, w, b, cfg, gelu_from=None, out=None):
    """x [M, K] @ w[N, K]^T + b, GELU on columns >= gelu_from (None: no GELU)."""
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, g, nw, ns = cfg
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    gemm_bias_kernel[grid](x, w, b if b is not None else x, y, M, N, K, x.stride(0),
                           w.stride(0), y.stride(0), 0 if gelu_from is None else gelu_from,
                           HAS_BIAS=b is not None, GELU=gelu_from is not None,
                           EVEN_K=K % bk == 0, IEEE=x.dtype == torch.float32,
                           BM=bm, BN=bn, BK=bk, GROUP_M=g, num_warps=nw, num_stages=ns)
    return y


def make_tma(x, w, b, cfg, gelu_from=None):
    """A TMA launch bound to these buffers (descriptors built once, outside the graph):
    returns fn() -> y."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, g, nw, ns = cfg
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    yd = TensorDescriptor.from_tensor(y, [bm, bn])
    progs = min(sm_count(x.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))

    def fn():
        gemm_bias_tma_kernel[(progs,)](xd, wd, b if b is not None else x, yd, M, N, K,
                                       0 if gelu_from is None else gelu_from, progs,
                                       HAS_BIAS=b is not None, GELU=gelu_from is not None,
                                       IEEE=x.dtype == torch.float32,
                                       BM=bm, BN=bn, BK=bk, GROUP_M=g, num_warps=nw,
                                       num_stages=ns)
        return y
    return fn


# ---------------------------------------------------------------------------- shapes

def shapes(smoke: bool):
    """(name, M, K, N, gelu, crops) - crops: the leading dim of a 3-D view (vision)."""
    if smoke:
        return [("vis.qkv", 45, 32, 96, False, 9), ("vis.fc1", 45, 32, 72, True, 9),
                ("vis.fc2", 45, 88, 32, False, 9), ("pre4.fc2", 40, 64, 32, False, 4)]
    out = [("vis.qkv", 6561, 1152, 3456, False, 9), ("vis.proj", 6561, 1152, 1152, False, 9),
           ("vis.fc1", 6561, 1152, 4304, True, 9), ("vis.fc2", 6561, 4304, 1152, False, 9)]
    for frames in (1, 4):
        m = 730 * frames
        out += [(f"pre{frames}.qkv", m, 2048, 6144, False, frames),
                (f"pre{frames}.proj", m, 2048, 2048, False, frames),
                (f"pre{frames}.fc1", m, 2048, 8192, True, frames),
                (f"pre{frames}.fc2", m, 8192, 2048, False, frames)]
    return out


def pairs(smoke: bool):
    """Prefill pairs: (name, M, K_attn, dim, ff)."""
    if smoke:
        return [("pre4.pair", 40, 32, 32, 64)]
    return [(f"pre{f}.pair", 730 * f, 2048, 2048, 8192) for f in (1, 4)]


# ------------------------------------------------------------------------------- timing

class Timer:
    def __init__(self, calls: int, replays: int, smoke: bool, budget_s: float = 1e9):
        self.calls, self.replays, self.smoke = calls, replays, smoke
        self.deadline = time.time() + budget_s

    def over(self) -> bool:
        return time.time() > self.deadline

    def __call__(self, fn) -> float | None:
        """ms per call of fn(): a CUDA graph of `calls` back-to-back calls, median of
        `replays` replays (bench_timing.graph_ms); on the CPU (smoke) one call's wall time."""
        if self.smoke:                # the plumbing only: one call's CPU wall time
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return graph_ms(fn, self.calls, self.replays)


def gelu_t(y):
    return F.gelu(y, approximate="tanh")


def addmm_gelu(b, x, wt, out=None):
    """The fused epilogue form on CUDA; on the CPU (smoke) its tanh equivalent (the CPU
    _addmm_activation applies the erf GELU)."""
    if x.is_cuda:
        if out is None:
            return torch._addmm_activation(b, x, wt, use_gelu=True)
        return torch._addmm_activation(b, x, wt, use_gelu=True, out=out)
    y = gelu_t(torch.addmm(b, x, wt))
    if out is not None:
        out.copy_(y)
        return out
    return y


class Settings:
    """Context: apply one matmul setting, restore it after."""
    def __init__(self, kind: str, value):
        self.kind, self.value = kind, value

    def __enter__(self):
        m = torch.backends.cuda.matmul
        if self.kind == "bf16_reduced":
            self.old = m.allow_bf16_reduced_precision_reduction
            try:                      # (allow reduced precision, allow split-K) where known
                self.old = (self.old, m.allow_bf16_reduced_precision_reduction_split_k)
            except AttributeError:
                pass
            m.allow_bf16_reduced_precision_reduction = self.value
        elif self.kind == "blas":
            self.old = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(self.value)
        return self

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        if self.kind == "bf16_reduced":
            m.allow_bf16_reduced_precision_reduction = self.old
        elif self.kind == "blas":
            torch.backends.cuda.preferred_blas_library(self.old)


# -------------------------------------------------------------------------------- forms

def forms_for(name, M, K, N, gelu, crops, x, w, b, smoke):
    """[(form name, fn() -> [M, N] output, note)] - all equivalent to the current form."""
    act = gelu_t if gelu else (lambda y: y)
    fs = []

    def add(fname, fn, note=""):
        fs.append((fname, fn, note))

    if gelu:
        add("current", lambda: addmm_gelu(b, x, w.t()), "_addmm_activation(use_gelu)")
        add("linear+gelu", lambda: gelu_t(F.linear(x, w, b)), "2 kernels")
        add("addmm+gelu", lambda: gelu_t(torch.addmm(b, x, w.t())), "2 kernels")
    else:
        add("current", lambda: F.linear(x, w, b), "F.linear")
        add("addmm", lambda: torch.addmm(b, x, w.t()))
        add("mm+bias", lambda: torch.matmul(x, w.t()) + b, "2 kernels")
        add("linear+bias_", lambda: F.linear(x, w).add_(b), "2 kernels")
    # the same call over 4 copies of the weights in turn (the graph's calls cycle them): the
    # encode's layers each read their own weights, so this is nearer to its L2 traffic
    wcopies = [w] + [w.clone() for _ in range(3)]
    turn = itertools.count()
    if gelu:
        add("current rot4W", lambda: addmm_gelu(b, x, wcopies[next(turn) % 4].t()),
            "4 weight copies in turn (less L2 reuse)")
    else:
        add("current rot4W", lambda: F.linear(x, wcopies[next(turn) % 4], b),
            "4 weight copies in turn (less L2 reuse)")
    if crops > 1 and M % crops == 0 and not gelu:
        x3 = x.view(crops, M // crops, K)
        add("linear3d", lambda: F.linear(x3, w, b).view(M, N))
    wt = w.t().contiguous()                                         # [K, N]
    if gelu:
        add("Wt", lambda: addmm_gelu(b, x, wt), "weights [K, N]")
    else:
        add("Wt", lambda: torch.addmm(b, x, wt), "weights [K, N]")
        add("Wt matmul", lambda: torch.matmul(x, wt) + b, "2 kernels")
    bc = b[:, None]
    add("outT", lambda: act(torch.addmm(bc, w, x.t())).t(), "[N, M] (a view)")
    add("outT+T", lambda: act(torch.addmm(bc, w, x.t())).t().contiguous(),
        "[N, M] + copy to [M, N]")
    for k in (2, 3):
        if N % k == 0 and (N // k) % 8 == 0:
            n = N // k
            ws = [w[i * n:(i + 1) * n] for i in range(k)]
            bs = [b[i * n:(i + 1) * n] for i in range(k)]
            if gelu:
                def split(ws=ws, bs=bs):
                    return [addmm_gelu(bi, x, wi.t()) for wi, bi in zip(ws, bs)]
            else:
                def split(ws=ws, bs=bs):
                    return [F.linear(x, wi, bi) for wi, bi in zip(ws, bs)]
            add(f"splitN{k}", split, "separate outputs")
            add(f"splitN{k}+cat", lambda split=split: torch.cat(split(), 1))
    chunks = sorted({c for c in (2, 3, crops) if 1 < c <= M and M % c == 0})
    for c in chunks:
        rows = M // c

        def splitm(rows=rows, c=c):
            y = torch.empty(M, N, dtype=x.dtype, device=x.device)
            for i in range(c):
                sl = slice(i * rows, (i + 1) * rows)
                if gelu:
                    addmm_gelu(b, x[sl], w.t(), out=y[sl])
                else:
                    torch.addmm(b, x[sl], w.t(), out=y[sl])
            return y
        add(f"splitM{c}", splitm, f"{c} x {rows} rows, out=")
    padded = {M}
    for p in ((8, 16) if smoke else (128, 256)):
        mp = -(-M // p) * p
        if mp in padded:
            continue
        padded.add(mp)
        xp = torch.zeros(mp, K, dtype=x.dtype, device=x.device)
        xp[:M] = x
        if gelu:
            add(f"padM{p}", lambda xp=xp: addmm_gelu(b, xp, w.t())[:M], f"M -> {mp}")
        else:
            add(f"padM{p}", lambda xp=xp: F.linear(xp, w, b)[:M], f"M -> {mp}")
    # N or K padded to a multiple of 128 with zero weights (vision ff = 4304 -> 4352 = 17 x
    # 256): fc1's padded columns are gelu(0 + 0) = 0, so fc2 over the padded K (zero weight
    # columns) gives the same sums - the pair of pads is one equivalent model change
    q = 16 if smoke else 128
    if N % q:
        np_ = -(-N // q) * q
        wp = torch.zeros(np_, K, dtype=w.dtype, device=w.device)
        wp[:N] = w
        bp = torch.zeros(np_, dtype=b.dtype, device=b.device)
        bp[:N] = b
        if gelu:
            add(f"padN{q}", lambda: addmm_gelu(bp, x, wp.t())[:, :N], f"N -> {np_} (zero rows)")
        else:
            add(f"padN{q}", lambda: F.linear(x, wp, bp)[:, :N], f"N -> {np_} (zero rows)")
    if K % q:
        kp = -(-K // q) * q
        xk = torch.zeros(M, kp, dtype=x.dtype, device=x.device)
        xk[:, :K] = x
        wk = torch.zeros(N, kp, dtype=w.dtype, device=w.device)
        wk[:, :K] = w
        if gelu:
            add(f"padK{q}", lambda: addmm_gelu(b, xk, wk.t()), f"K -> {kp} (zero columns)")
        else:
            add(f"padK{q}", lambda: F.linear(xk, wk, b), f"K -> {kp} (zero columns)")
    cur = fs[0][1]
    if x.is_cuda:
        red = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        for v in (not red, (red, False), (False, False)):   # tuples: (reduced, split-K)
            add(f"set:bf16_reduced={v}".replace(" ", ""), ("bf16_reduced", v),
                "setting (reduced precision, split-K)")
        for lib in ("cublaslt", "cublas"):
            add(f"set:blas={lib}", ("blas", lib), "setting")
    if HAVE_TRITON:
        gf = 0 if gelu else None
        for c in (SMOKE_CONFIGS if smoke else TILED_CONFIGS):
            add("triton " + _cfg_name(c), lambda c=c: triton_gemm(x, w, b, c, gf))
        for c in (SMOKE_CONFIGS if smoke else TMA_CONFIGS):
            add("tma " + _cfg_name(c), ("tma", c, gf), "persistent")
    return fs, cur


def _as_out(y):
    return torch.cat(y, 1) if isinstance(y, list) else y


def compare(y, ref, ref32) -> dict:
    y = _as_out(y)
    d = (y.float() - ref.float()).abs()
    scale = ref.float().abs().clamp_min(1e-3)
    return dict(max_abs=float(d.max()), max_rel=float((d / scale).max()),
                bitwise=bool(torch.equal(y, ref)),
                err_fp32=float((y.float() - ref32).abs().max()))


def run_form(timer, fname, fn, note, flops, ref, ref32, base_ms, x, w, b, gelu) -> dict:
    row = dict(form=fname, note=note)
    if timer.over():
        row["error"] = "skipped: over --budget-s"
        return row
    try:
        if isinstance(fn, tuple) and fn[0] in ("bf16_reduced", "blas"):
            with Settings(*fn):
                cur = (lambda: addmm_gelu(b, x, w.t())) if gelu else (lambda: F.linear(x, w, b))
                y = cur()
                ms = timer(cur)
        else:
            if isinstance(fn, tuple) and fn[0] == "tma":
                fn = make_tma(x, w, b, fn[1], fn[2])
            y = fn()
            ms = timer(fn)
        if x.is_cuda:
            torch.cuda.synchronize()
        row.update(compare(y, ref, ref32))
        row["ms"] = None if ms is None else round(ms, 4)
        if ms:
            row["tflops"] = round(flops / ms / 1e9, 1)
            row["ratio"] = round(base_ms / ms, 3) if base_ms else None
    except Exception as e:  # noqa: BLE001 - reported, the rest run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


def probe_shape(timer, spec, dtype, device, smoke, gen) -> dict:
    name, M, K, N, gelu, crops = spec
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(device, dtype)
    b = (torch.randn(N, generator=gen) * 0.1).to(device, dtype)
    ref32 = F.linear(x.float(), w.float(), b.float())
    if gelu:
        ref32 = gelu_t(ref32)
    fs, cur = forms_for(name, M, K, N, gelu, crops, x, w, b, smoke)
    ref = cur()
    flops = 2.0 * M * N * K
    rows = run_forms(timer, fs, flops, ref, ref32, x, w, b, gelu, device)
    return dict(shape=name, M=M, K=K, N=N, gelu=gelu, rows=rows)


def run_forms(timer, fs, flops, ref, ref32, x, w, b, gelu, device=None) -> list[dict]:
    """run_form for each (name, fn, note) of fs; "current" (first) is the ratio's base."""
    rows, base_ms = [], None
    for fname, fn, note in fs:
        r = run_form(timer, fname, fn, note, flops, ref, ref32, base_ms, x, w, b, gelu)
        if fname == "current":
            base_ms = r.get("ms")
            if base_ms:
                r["ratio"] = 1.0
        rows.append(r)
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def probe_pair(timer, spec, dtype, device, smoke, gen) -> list[dict]:
    """The prefill's parallel block: (a) proj + fc2 summed (current: F.linear + addmm_),
    vs one GEMM over [attn | g] @ [Wp | W2]^T; (b) qkv + fc1 on the same input as one GEMM
    over N (GELU on the fc1 columns)."""
    name, M, da, dim, ff = spec
    out = []
    a = torch.randn(M, da, generator=gen).to(device, dtype)
    g = (torch.randn(M, ff, generator=gen) * 0.5).to(device, dtype)
    wp = (torch.randn(dim, da, generator=gen) / math.sqrt(da + ff)).to(device, dtype)
    w2 = (torch.randn(dim, ff, generator=gen) / math.sqrt(da + ff)).to(device, dtype)
    bp = (torch.randn(dim, generator=gen) * 0.1).to(device, dtype)
    ref32 = F.linear(a.float(), wp.float(), bp.float()) + F.linear(g.float(), w2.float())

    def current():
        t = F.linear(a, wp, bp)
        t.addmm_(g, w2.t())
        return t
    ag = torch.cat([a, g], 1)
    wc = torch.cat([wp, w2], 1).contiguous()
    fs = [("current", current, "F.linear + addmm_ (beta=1)"),
          ("two+add", lambda: F.linear(a, wp, bp) + F.linear(g, w2), "3 kernels"),
          ("catK", lambda: F.linear(ag, wc, bp), f"one GEMM K={da + ff} (input pre-concatenated)"),
          ("catK+cat", lambda: F.linear(torch.cat([a, g], 1), wc, bp), "incl. torch.cat")]
    if HAVE_TRITON:
        for c in (SMOKE_CONFIGS if smoke else TILED_CONFIGS[:3]):
            fs.append(("catK triton " + _cfg_name(c), lambda c=c: triton_gemm(ag, wc, bp, c),
                       "bias epilogue"))
    ref = current()
    flops = 2.0 * M * dim * (da + ff)
    rows = run_forms(timer, fs, flops, ref, ref32, a, wp, bp, False)
    out.append(dict(shape=name + ".proj+fc2", M=M, K=da + ff, N=dim, gelu=False, rows=rows))

    # (b) qkv [dim -> 3 dim] and fc1 [dim -> ff] + GELU on the same input
    nq = 3 * dim
    x = torch.randn(M, dim, generator=gen).to(device, dtype)
    wq = (torch.randn(nq, dim, generator=gen) / math.sqrt(dim)).to(device, dtype)
    w1 = (torch.randn(ff, dim, generator=gen) / math.sqrt(dim)).to(device, dtype)
    bq = (torch.randn(nq, generator=gen) * 0.1).to(device, dtype)
    b1 = (torch.randn(ff, generator=gen) * 0.1).to(device, dtype)
    wcat = torch.cat([wq, w1], 0).contiguous()
    bcat = torch.cat([bq, b1], 0).contiguous()
    r32 = F.linear(x.float(), wcat.float(), bcat.float())
    r32 = torch.cat([r32[:, :nq], gelu_t(r32[:, nq:])], 1)

    def current2():
        return [F.linear(x, wq, bq), addmm_gelu(b1, x, w1.t())]

    def catn():
        y = F.linear(x, wcat, bcat)
        return [y[:, :nq], gelu_t(y[:, nq:])]
    fs = [("current", current2, "F.linear + _addmm_activation"),
          ("catN+gelu", catn, f"one GEMM N={nq + ff}, GELU kernel on the fc1 columns")]
    if HAVE_TRITON:
        for c in (SMOKE_CONFIGS if smoke else TILED_CONFIGS[:3]):
            fs.append(("catN triton " + _cfg_name(c),
                       lambda c=c: triton_gemm(x, wcat, bcat, c, gelu_from=nq),
                       "GELU epilogue on columns >= 3 dim"))
    ref = _as_out(current2())
    flops = 2.0 * M * (nq + ff) * dim
    rows = run_forms(timer, fs, flops, ref, r32, x, wcat, bcat, False)
    out.append(dict(shape=name + ".qkv+fc1", M=M, K=dim, N=nq + ff, gelu=True, rows=rows))
    return out


# --------------------------------------------------------------------------------- output

def table(res: dict) -> str:
    lines = [f"\n### {res['shape']}  M={res['M']} K={res['K']} N={res['N']}"
             f"{' +GELU' if res['gelu'] else ''}",
             "| form | ms | TFLOP/s | vs current | max abs | max rel | bitwise | err fp32 | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['form']} | - | - | - | - | - | - | - | FAILED: {r['error']} |")
            continue
        f = (lambda v, p=4: "-" if v is None else f"{v:.{p}g}")
        lines.append(f"| {r['form']} | {f(r.get('ms'))} | {f(r.get('tflops'))} | "
                     f"{f(r.get('ratio'), 3)} | {f(r['max_abs'], 3)} | {f(r['max_rel'], 3)} | "
                     f"{'yes' if r['bitwise'] else 'no'} | {f(r['err_fp32'], 3)} | {r['note']} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Per shape: the current form and the fastest form (and by how much)."""
    lines = ["\n### best form per shape (all forms; and the best cuBLAS-only one)",
             "| shape | current ms | TFLOP/s | rot4W ms | best form | ms | TFLOP/s | speed-up | "
             "bitwise | best cuBLAS form | ms | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        ok = [r for r in res["rows"] if r.get("ms")]
        cur = next((r for r in ok if r["form"] == "current"), None)
        if not ok or cur is None:
            continue
        rot = next((r for r in ok if r["form"] == "current rot4W"), None)
        ok = [r for r in ok if r["form"] != "current rot4W"]      # not a form: a baseline
        best = min(ok, key=lambda r: r["ms"])
        cub = min((r for r in ok if "triton" not in r["form"] and "tma" not in r["form"]),
                  key=lambda r: r["ms"])
        lines.append(f"| {res['shape']} | {cur['ms']} | {cur['tflops']} | "
                     f"{rot['ms'] if rot else '-'} | {best['form']} | "
                     f"{best['ms']} | {best['tflops']} | {cur['ms'] / best['ms']:.3f} | "
                     f"{'yes' if best['bitwise'] else 'no'} | {cub['form']} | {cub['ms']} | "
                     f"{cur['ms'] / cub['ms']:.3f} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------- compile

def compile_sm90(dtype=torch.bfloat16) -> list[dict]:
    """Compile every Triton config at the real shapes for sm_90 with Triton's bundled ptxas
    (no GPU): registers, spills, shared memory (ops/launch_resources)."""
    from photon_core.ops.launch_resources import Launch, compile_launch
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    out = []
    for gelu in (False, True):
        for c in TILED_CONFIGS:
            for even_k in (True, False):
                bm, bn, bk, g, nw, ns = c
                sig = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", b_ptr=f"*{dt}", y_ptr=f"*{dt}",
                           M="i32", N="i32", K="i32", sxm="i32", swn="i32", sym="i32",
                           gelu_from="i32")
                cx = dict(HAS_BIAS=True, GELU=gelu, EVEN_K=even_k, IEEE=False, BM=bm, BN=bn,
                          BK=bk, GROUP_M=g)
                for k in cx:
                    sig[k] = "constexpr"
                attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 7, 8, 9)}
                la = Launch(gemm_bias_kernel, sig, cx, attrs, dict(num_warps=nw, num_stages=ns))
                r = compile_launch(la)
                out.append(dict(kernel="tiled", cfg=_cfg_name(c), gelu=gelu, even_k=even_k,
                                registers=r.registers, spill=r.spill, shared=r.shared,
                                fits=r.fits, error=r.error))
        for c in TMA_CONFIGS:
            bm, bn, bk, g, nw, ns = c
            sig = dict(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                       w_desc=f"tensordesc<{dt}[{bn}, {bk}]>", b_ptr=f"*{dt}",
                       y_desc=f"tensordesc<{dt}[{bm}, {bn}]>", M="i32", N="i32", K="i32",
                       gelu_from="i32", num_progs="i32")
            cx = dict(HAS_BIAS=True, GELU=gelu, IEEE=False, BM=bm, BN=bn, BK=bk,
                      GROUP_M=g)
            for k in cx:
                sig[k] = "constexpr"
            la = Launch(gemm_bias_tma_kernel, sig, cx, {(2,): [["tt.divisibility", 16]]},
                        dict(num_warps=nw, num_stages=ns))
            r = compile_launch(la)
            out.append(dict(kernel="tma", cfg=_cfg_name(c), gelu=gelu, even_k=None,
                            registers=r.registers, spill=r.spill, shared=r.shared,
                            fits=r.fits, error=r.error))
    return out


# ----------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--only", default="", help="comma list of shape-name prefixes")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200,
                    help="forms not started by then are skipped (the run stays < 4 min)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    global HAVE_TRITON
    if a.no_triton:
        HAVE_TRITON = False
    if a.compile:
        rows = compile_sm90()
        print(f"triton {triton.__version__}, sm_90 (bundled ptxas), bf16")
        print("| kernel | config | gelu | even K | regs | spill | shared | fits |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kernel']} | {r['cfg']} | {r['gelu']} | {r['even_k']} | "
                  f"{r['registers']} | {r['spill']} | {r['shared']} | {r['fits']} |"
                  + (f" {r['error']}" if r["error"] else ""))
        sys.exit(0 if all(r["fits"] for r in rows) else 1)
    smoke = a.smoke or not torch.cuda.is_available()
    if smoke and not a.smoke:
        print("no CUDA: running the smoke mode")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    t0 = time.time()
    info = dict(torch=torch.__version__, triton=triton.__version__ if HAVE_TRITON else None,
                device=torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
                dtype=str(dtype), calls=a.calls, replays=a.replays,
                bf16_reduced=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    try:
        info["blas"] = str(torch.backends.cuda.preferred_blas_library())
    except Exception as e:  # noqa: BLE001
        info["blas"] = f"n/a ({type(e).__name__})"
    print(json.dumps(info))
    if smoke:
        print("SMOKE: CPU, tiny shapes, fp32, Triton interpreted; 'ms' is one call's CPU wall "
              "time (checks the plumbing, measures nothing)")
    timer = Timer(a.calls, a.replays, smoke, a.budget_s)
    gen = torch.Generator().manual_seed(0)
    only = [s for s in a.only.split(",") if s]
    results = []
    with torch.inference_mode():
        for spec in shapes(smoke):
            if only and not any(spec[0].startswith(o) for o in only):
                continue
            try:
                res = probe_shape(timer, spec, dtype, device, smoke, gen)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res = dict(shape=spec[0], M=spec[1], K=spec[2], N=spec[3], gelu=spec[4],
                           rows=[], error=f"{type(e).__name__}: {e}")
            results.append(res)
            print(table(res), f"\n({time.time() - t0:.0f} s)", flush=True)
        for spec in pairs(smoke):
            if only and not any(spec[0].startswith(o) for o in only):
                continue
            try:
                for res in probe_pair(timer, spec, dtype, device, smoke, gen):
                    results.append(res)
                    print(table(res), f"\n({time.time() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                results.append(dict(shape=spec[0], rows=[], error=f"{type(e).__name__}: {e}"))
    fails = sum("error" in r for res in results for r in res["rows"])
    fails += sum("error" in res for res in results)
    bad = []
    if smoke:     # fp32 on the CPU: every form must give the current form's output
        bad = [f"{res['shape']}/{r['form']}: max abs {r['max_abs']:.3g}"
               for res in results for r in res["rows"]
               if "error" not in r and r["max_abs"] > 1e-4]
        print("smoke: " + ("all forms agree with the current one (max abs <= 1e-4)"
                           if not bad else "DIFFERENT: " + "; ".join(bad)))
    blob = dict(info=info, results=results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        p = Path(os.environ["OUT"]) / "probe_gemm_forms.json"
        p.write_text(json.dumps(blob, indent=1))
        md = Path(os.environ["OUT"]) / "probe_gemm_forms.md"
        md.write_text(json.dumps(info) + "\n" + "\n".join(table(r) for r in results)
                      + "\n" + summary(results) + "\n")
        print(f"wrote {p} and {md}")
    else:
        print(json.dumps(blob))
    print(summary(results))          # last: what the output's tail shows
    print(f"\n{sum(len(r['rows']) for r in results)} forms, {fails} failed, "
          f"{time.time() - t0:.0f} s")
    if smoke and (bad or fails):
        sys.exit(1)


if __name__ == "__main__":
    main()
