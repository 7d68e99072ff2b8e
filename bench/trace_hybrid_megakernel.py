"""Where a hybrid megakernel step's time goes, instruction by instruction (H200; Qwen 3.5
0.8B / Gemma 4 E2B shapes, random bf16 weights: bench/sweep_gemv_family.build_model): the
build with TRACE (hybrid_kernel.py: every instruction writes its start and end on the GPU's
global ns timer) is launched --launches times over the same state (rows inactive at
position --pos, as bench_gemma4_fast.graph_step_ms times steps), and each instruction's
median start / end is summarized by trace_megakernel.analyze: per op kind the time, the part
spent waiting for its inputs (stall) and the rest (work, with the GEMVs' bytes per
microsecond of work per program), per program work / stall / idle at the end, and the ops
whose last instruction ended long after their median one (stragglers). The untraced launch
is timed too (bench_timing.median_ms, same state).

Usage (H200): PYTHONPATH=. python3 bench/trace_hybrid_megakernel.py
                  [--families qwen3.5-0.8b,gemma4-e2b] [--variant auto/w8/s3]
                  [--launches 5] [--pos 300]
Writes $OUT/trace_hybrid_megakernel.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_timing import median_ms  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402
from trace_megakernel import analyze, median_trace, print_kinds  # noqa: E402


def trace_family(fam: str, variant: str, launches: int, pos: int) -> dict:
    from photon_core.fast import FastEngine
    model = build_model(fam)
    fe = FastEngine(model, max_batch=1, kv_capacity=1024, megakernel=variant)
    be = fe.state.megakernel
    if be is None:
        raise SystemExit(f"{fam}: the megakernel is not in use: "
                         f"{fe.state.megakernel_fallback}")
    step = be.step_for(1)
    fe.state.active.zero_()
    fe.state.pos.fill_(pos)
    c = step.compiled
    med, trace = median_trace(step.run_kernel, len(c.instrs), launches, "cuda",
                              torch.cuda.synchronize)
    elsize = torch.tensor([], dtype=step.st.hidden.dtype).element_size()
    a = analyze(c, med[:, 0].tolist(), med[:, 1].tolist(), step.low.shape, elsize)
    res = {k: x for k, x in a.items() if not k.startswith("_")}
    dev = torch.device("cuda")
    res["untraced_launch_ms"] = median_ms(step.run_kernel, dev)
    res["traced_launch_ms"] = median_ms(lambda: step.run_kernel(trace=trace), dev)
    res["instructions"], res["programs_launched"] = len(c.instrs), c.n_programs
    fe.close()
    return res


def report(fam: str, r: dict) -> None:
    print(f"{fam}: launch {r['untraced_launch_ms']:.4f} ms (traced {r['traced_launch_ms']:.4f}"
          f"), traced makespan {r['makespan_us']:.1f} us (model {r['model_makespan_us']:.1f})"
          f", {r['instructions']} instructions on {r['programs_launched']} programs",
          flush=True)
    mp = r["mean_program"]
    print(f"  per program (mean us): work {mp['work']:.1f}, stall {mp['stall']:.1f}, gaps "
          f"{mp['gaps']:.1f}, idle at the end {mp['tail_idle']:.1f}", flush=True)
    print_kinds(fam, r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3.5-0.8b,gemma4-e2b")
    ap.add_argument("--variant", default="auto/w8/s3")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--pos", type=int, default=300)
    args = ap.parse_args()
    out = {"gpu": torch.cuda.get_device_name(), "variant": args.variant, "families": {}}
    for fam in args.families.split(","):
        out["families"][fam] = r = trace_family(fam, args.variant, args.launches, args.pos)
        report(fam, r)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trace_hybrid_megakernel.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
