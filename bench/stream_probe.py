"""How fast can one persistent program per SM stream weights through the megakernel's GEMV code
(issue 12)? On the H200, one process, same-run baselines.

The megakernel's GEMV instructions run at ~2.5 TB/s inside the kernel (docs/benchmarks.md,
"GEMVs only": no dependency waits) against ~4.2 TB/s copy bandwidth. This probe runs the very
same @triton.jit GEMV body (photon_core.megakernel.kernel._gemv_pipe, batch 1, FMA or tensor
cores) over a weight matrix much larger than L2, with no instruction table and no waits,
varying one thing at a time:
  - the work per call of the body ("instruction" of R rows x K, or one FLAT stream per program),
  - programs per SM (1 or 2), warps, pipeline stages, the tile rows;
against, in the same run: device copy bandwidth (torch, read + write), cuBLAS F.linear on the
same matrix, and the same body launched as an ordinary grid (one program per instruction,
many programs resident per SM: what the fused path's GEMV kernels do).
GB/s = weight bytes / time (the x vector and outputs are small).

Usage: PYTHONPATH=. python3 bench/stream_probe.py [--mb 560] [--iters 20] [--cases fma|dot|all]
       TRITON_INTERPRET=1 python3 bench/stream_probe.py --smoke     (CPU: the code runs, checked
       against torch; no timing value)
Writes $OUT/stream_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core.megakernel.kernel import _gemv_pipe  # noqa: E402
from photon_core.megakernel.megakernel_step import sm_count  # noqa: E402
from photon_core.ops._triton import tl, triton  # noqa: E402


@triton.jit
def _body(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n1, K: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr):
    """kernel._gemv_pipe over rows [n0, n1) as a plain GEMV: no waits (both -1), no
    LayerNorm (field 19 = -1), no trace / record prefetch / early epilogue operands."""
    _gemv_pipe(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n1, 0, 0, 0, 0, y_ptr, x_ptr, y_ptr, 0,
               0.0, -1, 0, -1, 0, 0, 0, 0, -1, 1, K, 0, 16 if DOT else 1, BN, BK, DOT,
               STAGES, False, K, 16, False, 0, y_ptr, False, w_ptr, False, False)


@triton.jit
def _probe(w_ptr, x_ptr, bias_ptr, y_ptr, rows_per_prog, rows_per_instr, n_instr_total,
           K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
           STAGES: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: persistent, the program's rows as instructions of rows_per_instr rows, one
    _gemv_pipe call each; 1: persistent, one _gemv_pipe call over all the program's rows;
    2: ordinary grid, program i = instruction i."""
    pid = tl.program_id(0)
    if MODE == 2:
        n0 = pid * rows_per_instr
        _body(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n0 + rows_per_instr, K, BN, BK, DOT, STAGES)
    elif MODE == 1:
        n0 = pid * rows_per_prog
        _body(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n0 + rows_per_prog, K, BN, BK, DOT, STAGES)
    else:
        r0 = pid * rows_per_prog
        for i in range(0, rows_per_prog, rows_per_instr):
            _body(x_ptr, w_ptr, bias_ptr, y_ptr, r0 + i, r0 + i + rows_per_instr, K, BN, BK,
                  DOT, STAGES)


MODES = {"instr": 0, "flat": 1, "grid": 2}


def run_case(w, x, bias, y, n_sm, case):
    """case: dict(mode, per_sm, warps, stages, bn, bk, instr_kb, dot[, frac]) -> launch
    callable. frac < 1 (persistent modes): only that share of the per_sm * n_sm programs is
    launched - the megakernel's attention phase, where ~96 of its 264 programs wait on
    attention's latency chain and the others stream (a program's bytes in flight, not the
    HBM, may then bound the rate)."""
    n, k = w.shape
    progs = max(1, int(n_sm * case["per_sm"] * case.get("frac", 1.0)))
    rows_per_prog = n // progs
    rows_per_instr = max(case["bn"], case["instr_kb"] * 1024 // (k * w.element_size()))
    rows_per_instr = min(rows_per_instr // case["bn"] * case["bn"], rows_per_prog)
    if case["mode"] == "instr":      # whole instructions (none reads past the matrix)
        rows_per_prog = rows_per_prog // rows_per_instr * rows_per_instr
    mode = MODES[case["mode"]]
    grid = (n // rows_per_instr,) if mode == 2 else (progs,)

    def go():
        _probe[grid](w, x, bias, y, rows_per_prog, rows_per_instr, n // rows_per_instr,
                     K=k, BN=case["bn"], BK=case["bk"], DOT=case.get("dot", False),
                     STAGES=case["stages"], MODE=mode, num_warps=case["warps"],
                     num_stages=case["stages"])
    covered = (n // rows_per_instr) * rows_per_instr if mode == 2 else \
        progs * (rows_per_prog // rows_per_instr) * rows_per_instr if mode == 0 else \
        progs * rows_per_prog
    return go, covered


def cuda_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[1]


def default_cases():
    base = dict(mode="instr", per_sm=1, warps=8, stages=4, bn=16, bk=512, instr_kb=256)
    cases = [dict(base, name="megakernel today (instr 256 KB, w8 s4 16x512)")]
    for name, ch in (("flat stream", dict(mode="flat")),
                     ("instr 64 KB", dict(instr_kb=64)),
                     ("instr 1 MB", dict(instr_kb=1024)),
                     ("s6", dict(stages=6)), ("s8", dict(stages=8)),
                     ("32x512", dict(bn=32)), ("8x1024", dict(bn=8, bk=1024)),
                     ("w4", dict(warps=4)),
                     ("p2 w4", dict(per_sm=2, warps=4)),
                     ("p2 w4 s6", dict(per_sm=2, warps=4, stages=6)),
                     ("p2 w8", dict(per_sm=2, warps=8)),
                     ("flat s8", dict(mode="flat", stages=8)),
                     ("grid (instr 64 KB per program)", dict(mode="grid", instr_kb=64)),
                     ("grid (instr 16 KB per program)", dict(mode="grid", instr_kb=16, bn=8)),
                     ("tensor cores 16x512", dict(dot=True))):
        cases.append(dict(base, name=name, **ch))
    return cases


def dot_cases():
    """Tensor-core (b > 1) streaming: tile rows x K, stages, warps, programs per SM."""
    base = dict(mode="instr", per_sm=1, warps=4, stages=4, bn=16, bk=512, instr_kb=256,
                dot=True)
    cases = []
    for bn, bk in ((16, 512), (16, 1024), (32, 512), (64, 256), (64, 128), (128, 128)):
        for per_sm, warps, stages in ((1, 4, 4), (2, 4, 3), (2, 4, 4), (1, 8, 4)):
            cases.append(dict(base, bn=bn, bk=bk, per_sm=per_sm, warps=warps, stages=stages,
                              name=f"dot {bn}x{bk} p{per_sm} w{warps} s{stages}"))
    cases.append(dict(base, mode="grid", instr_kb=64, bn=64, bk=128, name="dot grid 64x128"))
    return cases


def partial_cases():
    """b=1 FMA streaming when only part of the p2 programs stream (frac 1 vs 168 / 264, the
    megakernel's attention phase): does a deeper pipeline or a larger tile per program then
    raise the rate? Instructions of ~96 / ~288 KB (the megakernel's qkv / fill tiles)."""
    cases = []
    for frac in (1.0, 168 / 264):
        for bn, bk, stages in ((8, 1024, 3), (8, 1024, 4), (8, 1024, 5), (8, 2048, 3),
                               (16, 1024, 3)):
            for kb in (96, 288):
                cases.append(dict(mode="instr", per_sm=2, warps=4, stages=stages, bn=bn,
                                  bk=bk, instr_kb=kb, frac=frac,
                                  name=f"p2 w4 {bn}x{bk} s{stages} instr {kb} KB "
                                       f"frac {frac:.2f}"))
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=560, help="weight matrix MiB (K = 2048)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cases", choices=("fma", "dot", "all", "partial"), default="fma",
                    help="fma: the b=1 sweep; dot: tensor-core tiles (b > 1); all: both; "
                         "partial: b=1 with part of the programs streaming")
    args = ap.parse_args()
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    dt = torch.float32 if smoke else torch.bfloat16
    n_sm = 2 if smoke else sm_count("cuda")
    k = 1024 if smoke else args.k
    quantum = n_sm * 2 * 64          # rows divisible by every (programs x instruction rows)
    rows = 4 * quantum if smoke else \
        max(quantum, (args.mb * 2 ** 20 // (k * 2)) // quantum * quantum)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(rows, k, device=dev, dtype=dt, generator=g) * 0.02
    x = torch.randn(1, k, device=dev, dtype=dt, generator=g)
    bias = torch.zeros(rows, device=dev, dtype=dt)
    y = torch.zeros(1, rows, device=dev, dtype=dt)
    out = {"rows": rows, "k": k, "weight_MB": round(w.numel() * w.element_size() / 1e6, 1),
           "n_sm": n_sm, "cases": []}
    wbytes = w.numel() * w.element_size()
    if not smoke:
        src = torch.empty(wbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = cuda_ms(lambda: dst.copy_(src), args.iters)
        out["copy_GBps"] = round(2 * src.numel() / ms / 1e6, 1)
        del src, dst
        ms = cuda_ms(lambda: torch.nn.functional.linear(x, w), args.iters)
        out["cublas_GBps"] = round(wbytes / ms / 1e6, 1)
        print(f"copy {out['copy_GBps']} GB/s (read + write), cuBLAS F.linear "
              f"{out['cublas_GBps']} GB/s over {out['weight_MB']} MB", flush=True)
    ref = (x.float() @ w.float().t())
    cases = {"fma": default_cases(), "dot": dot_cases(), "partial": partial_cases(),
             "all": default_cases() + dot_cases()}[args.cases]
    if smoke:
        for c in cases:
            c.update(stages=min(c["stages"], 2), bk=min(c["bk"], 256), instr_kb=4)
    for c in cases:
        rec = dict(c)
        try:
            go, covered = run_case(w, x, bias, y, n_sm, c)
            y.zero_()
            go()
            err = (y.float()[0, :covered] - ref[0, :covered]).abs().max().item()
            rec["max_abs_err"] = round(err, 4)
            rec["ok"] = err < (1e-3 if smoke else 0.05 + 0.01 * ref.abs().max().item())
            if not smoke:
                ms = cuda_ms(go, args.iters)
                rec["ms"] = round(ms, 4)
                rec["GBps"] = round(covered * k * w.element_size() / ms / 1e6, 1)
                rec["of_copy"] = round(rec["GBps"] / out["copy_GBps"], 3)
        except Exception as e:  # noqa: BLE001
            rec["error"] = repr(e)[:400]
        out["cases"].append(rec)
        print(json.dumps(rec), flush=True)
    print("\n| case | GB/s | of copy | ok |\n|---|---|---|---|")
    for r in out["cases"]:
        print(f"| {r['name']} | {r.get('GBps', '-')} | {r.get('of_copy', '-')} | "
              f"{r.get('ok', r.get('error', '-'))} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "stream_probe.json").write_text(json.dumps(out, indent=1))
    if smoke and not all(r.get("ok") for r in out["cases"]):
        sys.exit(1)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"stream_probe: {time.perf_counter() - t0:.1f} s", flush=True)
