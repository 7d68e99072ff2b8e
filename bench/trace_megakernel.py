"""Where a megakernel step's time goes, instruction by instruction (H200, Moondream 2 shapes,
random bf16 weights, deterministic mode): the build with TRACE (kernel.py: every instruction
writes its start and end on the GPU's global ns timer, a GEMV also the moments its inputs
were ready, its LayerNorm done and its tile done) is launched a few times from the same
state, and each instruction's median times give

  - per op kind: instructions, measured time, the part spent waiting for its inputs (from
    the moment its dependency ops' last instruction ended: `stall`), the rest (`work`),
    against the compiler's cost model (compiler.py: cost = bytes / rate + a fixed cost (+ the
    attention latency); fill schedules - the "on" build - use FILL_SM_BYTES_PER_US /
    FILL_INSTR_US / ATTN_LATENCY_US, themselves fitted by this bench);
  - per program: work, stall, idle at the end of the step;
  - per op: how long after its median instruction its last one ended (stragglers);
  - per GEMV kind: its mean phases (gemv_phases: to ready / LayerNorm / tile / end).

--calibrate: the cost model refitted from the trace (GEMV work = bytes / rate + fixed by
least squares; attention's latency = its median work minus its modelled bytes), the schedule
rebuilt with it, and both schedules timed as graphs (same run), their greedy tokens checked
against the fused backend (a schedule moves instructions between programs; each output row
stays one instruction's sums, so the bits must not change), and the new one traced too.

--sweep "NAME=V,NAME=V;NAME=V;...": schedules built with those compiler constants (each set
on top of the defaults; "" = the defaults), timed as graphs in rounds (every set once per
round, --rounds), their greedy tokens and hidden states checked against the fused backend.

Usage: PYTHONPATH=. python3 bench/trace_megakernel.py [--variant on] [--launches 5]
           [--steps 64] [--max-batch 8] [--calibrate] [--sweep SETS] [--rounds 2] [--dump]
Writes $OUT/trace_megakernel.json when OUT is set.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_megakernel as bm  # noqa: E402


def instr_bytes(ins, shape, elsize) -> float:
    """The bytes compiler.split_ops prices an instruction by (a GEMV tile's weights, an
    attention instruction's k/v splits; 0 for the hybrid kernel's other ops)."""
    from photon_core.megakernel.instructions import (OP_ATTN, OP_GEMV_LM, OP_GEMV_W1,
                                                     OP_GEMV_W2, OP_HGEMV)
    if ins.op == OP_HGEMV:       # (the hybrid kernel's GEMVs: their K in the instruction)
        return (ins.tile[1] - ins.tile[0]) * ins.params["k"] * elsize
    if ins.op in (OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM):
        k = shape["KW2"] if ins.op == OP_GEMV_W2 else shape["D"]
        return (ins.tile[1] - ins.tile[0]) * k * elsize
    if ins.op == OP_ATTN:
        return (ins.sub[1] - ins.sub[0]) * 2 * shape["CHUNK"] * shape["HD"] * elsize
    return 0.0


def analyze(compiled, starts, ends, shape, elsize) -> dict:
    """starts / ends: ns per instruction (table order)."""
    from photon_core.megakernel.instructions import OP_NAMES
    ins = compiled.instrs
    t0 = min(starts)
    s = [(x - t0) / 1e3 for x in starts]
    e = [(x - t0) / 1e3 for x in ends]
    done: dict[int, float] = {}
    for i, x in enumerate(ins):
        done[x.signal] = max(done.get(x.signal, 0.0), e[i])
    stall, work = [], []
    for i, x in enumerate(ins):
        ready = max((done[c] for c, _ in x.waits), default=0.0)
        st = min(max(0.0, ready - s[i]), e[i] - s[i])
        stall.append(st)
        work.append(e[i] - s[i] - st)
    kinds: dict[str, dict] = {}
    for i, x in enumerate(ins):
        k = kinds.setdefault(OP_NAMES[x.op], {"n": 0, "time_us": 0.0, "stall_us": 0.0,
                                             "work_us": 0.0, "model_us": 0.0, "bytes": 0.0})
        k["n"] += 1
        k["time_us"] += e[i] - s[i]
        k["stall_us"] += stall[i]
        k["work_us"] += work[i]
        k["model_us"] += x.cost
        k["bytes"] += instr_bytes(x, shape, elsize)
    for k in kinds.values():
        k["work_per_instr_us"] = k["work_us"] / k["n"]
        k["model_per_instr_us"] = k["model_us"] / k["n"]
        k["GBps_per_program_work"] = k["bytes"] / max(k["work_us"], 1e-9) / 1e3
    qs = compiled.queue.tolist()
    makespan = max(e)
    progs = []
    for p in range(compiled.n_programs):
        idx = range(qs[p], qs[p + 1])
        if not len(idx):
            continue
        progs.append({"work": sum(work[i] for i in idx), "stall": sum(stall[i] for i in idx),
                      "gaps": sum(s[i] - e[i - 1] for i in idx if i > qs[p]),
                      "tail_idle": makespan - e[idx[-1]], "head": s[idx[0]]})
    per_op: dict[int, list[int]] = {}
    for i, x in enumerate(ins):
        per_op.setdefault(x.signal, []).append(i)
    stragglers = []
    for sig, idx in per_op.items():
        ends_ = sorted(e[i] for i in idx)
        stragglers.append({"op": ins[idx[0]].op_name, "n": len(idx),
                           "last_minus_median_end_us": ends_[-1] - ends_[len(ends_) // 2],
                           "done_us": ends_[-1]})
    stragglers.sort(key=lambda d: -d["last_minus_median_end_us"])

    def mean(key):
        return statistics.fmean(p[key] for p in progs)
    return {"makespan_us": makespan, "model_makespan_us": compiled.makespan_us,
            "programs": len(progs), "mean_program": {k: mean(k) for k in
                                                    ("work", "stall", "gaps", "tail_idle",
                                                     "head")},
            "kinds": kinds, "stragglers_top": stragglers[:12],
            "straggler_sum_us": sum(d["last_minus_median_end_us"] for d in stragglers),
            "_work": work, "_stall": stall}


def layer_timeline(compiled, starts, ends) -> dict:
    """Kernel.py's layer ops (w1qkv / attn / w1fc1 / w2) in us after the previous layer's
    last W2 end, means over the layers but the first and last: first start, median / 90th
    percentile / last end - where a layer's critical path goes."""
    ops: dict[str, list[int]] = {}
    for i, x in enumerate(compiled.instrs):
        ops.setdefault(x.op_name, []).append(i)
    layers = sorted(int(n.split(".")[1]) for n in ops if n.startswith("w2."))
    rows: dict[str, dict[str, list]] = {}
    for L in layers[1:-1]:
        t0 = max(ends[i] for i in ops[f"w2.{L - 1}"])
        for kind in ("w1qkv", "attn", "w1fc1", "w2"):
            idx = ops.get(f"{kind}.{L}")
            if not idx:
                continue
            e = sorted(ends[i] - t0 for i in idx)
            r = rows.setdefault(kind, {"first_start": [], "median_end": [], "p90_end": [],
                                       "last_end": []})
            r["first_start"].append(min(starts[i] for i in idx) - t0)
            r["median_end"].append(e[len(e) // 2])
            r["p90_end"].append(e[int(0.9 * (len(e) - 1))])
            r["last_end"].append(e[-1])
    return {k: {m: round(statistics.fmean(v) / 1e3, 2) for m, v in r.items()}
            for k, r in rows.items()}


def median_trace(run, n_instr: int, launches: int, device, sync, cols: int = 2):
    """(each instruction's median trace row - ns: (start, end) for the hybrid kernel, kernel.py's
    (start, inputs ready, LayerNorm done, tile done, end) with cols=5 - over `launches`
    launches of run(trace=...) - one more first: the TRACE build's compile -, the trace
    tensor)."""
    import torch
    trace = torch.zeros(n_instr, cols, dtype=torch.int64, device=device)
    runs = []
    for _ in range(launches + 1):
        run(trace=trace)
        sync()
        runs.append(trace.clone().cpu())
    return torch.stack(runs[1:]).median(dim=0).values, trace


def raw_rows(compiled, t) -> list:
    """Every instruction as [program, op name, tile, key splits, its 5 trace times in us from
    the step's first start (0 where the build does not write that column)]: a program's
    timeline, for analysis away from the GPU (--dump)."""
    t0 = int(t[:, 0].min())
    return [[x.sm, x.op_name, list(x.tile), list(x.sub),
             [round((int(v) - t0) / 1e3, 3) if int(v) > 0 else 0 for v in t[i].tolist()]]
            for i, x in enumerate(compiled.instrs)]


def gemv_phases(compiled, t, stall) -> dict:
    """kernel.py's GEMV instructions by phase (trace rows of 5, `stall`: analyze's): mean us
    per instruction from its start to its inputs' readiness as it saw it (of which `stall` is
    the wait for the producers' last end; the rest: the first weight tiles issued (pre), the
    polls' round trips), the LayerNorm (statistics, the scratch written, the CTA barrier),
    the tile (the K loop: streaming and epilogues), and the end (the CTA barrier and the
    release)."""
    from photon_core.megakernel.instructions import OP_NAMES, OP_GEMV_LM, OP_GEMV_W1, OP_GEMV_W2
    out: dict[str, dict] = {}
    for i, x in enumerate(compiled.instrs):
        if x.op not in (OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM):
            continue
        s0, ready, normed, looped, end = (int(v) for v in t[i].tolist())
        if min(ready, normed, looped) <= 0:
            continue
        us = {"to_ready": (ready - s0) / 1e3, "stall": stall[i], "ln": (normed - ready) / 1e3,
              "tile": (looped - normed) / 1e3, "end": (end - looped) / 1e3}
        k = out.setdefault(OP_NAMES[x.op] + (" (ln reused)" if x.ln_reuse else ""),
                           {"n": 0, **{f: 0.0 for f in us}})
        k["n"] += 1
        for f, v in us.items():
            k[f] += v
    for k in out.values():
        for f in k:
            if f != "n":
                k[f] = round(k[f] / k["n"], 3)
    return out


def print_kinds(tag: str, a: dict) -> None:
    """analyze()'s op kinds (work per instruction against the cost model, stall, GEMV bytes
    per us) and its top stragglers, a line each."""
    for name, k in a["kinds"].items():
        print(f"[{tag}]   {name}: {k['n']} instr, work {k['work_per_instr_us']:.2f} us "
              f"(model {k['model_per_instr_us']:.2f}), stall {k['stall_us']:.0f} us in all, "
              f"{k['GBps_per_program_work']:.1f} GB/s per program", flush=True)
    for d in a["stragglers_top"][:6]:
        print(f"[{tag}]   straggler {d['op']}: last {d['last_minus_median_end_us']:.2f} us "
              f"after the median ({d['n']} instr)", flush=True)


def fit_costs(compiled, a: dict, shape, elsize, per_sm: int) -> dict:
    """GEMV: work = bytes / rate + fixed (least squares); attention: its median work minus
    its modelled bytes and merge = the latency constant. Returns the compiler constants of
    fill schedules (what the fit is measured on: the "on" build)."""
    from photon_core.megakernel import compiler as C
    from photon_core.megakernel.instructions import OP_ATTN
    xs, ys, att = [], [], []
    for i, x in enumerate(compiled.instrs):
        if x.op in C.GEMV_OPS:
            xs.append(instr_bytes(x, shape, elsize))
            ys.append(a["_work"][i])
        elif x.op == OP_ATTN:
            att.append((i, x))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((u - mx) ** 2 for u in xs)
    slope = sum((u - mx) * (v - my) for u, v in zip(xs, ys)) / sxx if sxx else 0.0
    fixed = max(0.05, my - slope * mx)
    rate_prog = 1.0 / slope if slope > 0 else C.FILL_SM_BYTES_PER_US / per_sm
    sm_rate = rate_prog * per_sm          # the compiler divides by per_sm (fill schedules)
    ns = shape["NSPLIT"]
    merge = ns * (shape["HD"] + 2) * 4 / sm_rate
    lat = statistics.median(a["_work"][i] - instr_bytes(x, shape, elsize) / rate_prog
                            - fixed - merge for i, x in att) if att else C.ATTN_LATENCY_US
    return {"FILL_SM_BYTES_PER_US": sm_rate, "FILL_INSTR_US": fixed,
            "ATTN_LATENCY_US": max(0.0, lat)}


@contextlib.contextmanager
def compiler_constants(values: dict):
    """compiler.py's cost-model constants set to `values` while the block builds schedules
    (MegakernelStep compiles its schedule when built), restored after."""
    from photon_core.megakernel import compiler as C
    old = {k: getattr(C, k) for k in values}
    try:
        for k, x in values.items():
            setattr(C, k, x)
        yield
    finally:
        for k, x in old.items():
            setattr(C, k, x)


def sweep(c, b, v, args, s0, ref) -> list[dict]:
    """Each constant set's schedule: greedy agreement once, graph ms in --rounds rounds."""
    import torch

    from photon_core.megakernel.megakernel_step import MegakernelStep
    sets = []
    for part in args.sweep.split(";"):
        kv = dict(x.split("=") for x in part.split(",") if x.strip())
        sets.append({k.strip(): float(x) for k, x in kv.items()})
    steps, rows, first = [], [], None
    for cs in sets:
        with compiler_constants(cs):
            mk = MegakernelStep(c.fd, c.st, b, variant=v)

        def step(mk=mk):
            mk.feed()
            mk.run_kernel()
        c.restore(s0)
        got = bm._greedy(c, b, args.steps, step)
        first = first or got
        rows.append({"constants": cs, "model_makespan_us": mk.compiled.makespan_us,
                     "greedy": bm._agreement(ref, got),
                     "vs_first_set": bm._agreement(first, got), "graph_ms": []})
        steps.append(step)
    c.state_for(b, active=False)
    for _ in range(args.rounds):
        for r, step in zip(rows, steps):
            g = bm._graph(torch, step)
            r["graph_ms"].append(bm._timed(torch, g.replay))
            del g
    for r in rows:
        print(f"[sweep] {r['constants'] or 'defaults'}: graph ms "
              + " / ".join(f"{x:.4f}" for x in r["graph_ms"])
              + f", tokens {r['greedy']['tokens_equal']}/{r['greedy']['tokens_total']}, "
              f"hidden max diff {r['greedy']['max_hidden_diff']:.3g}, vs the first set: "
              f"bitwise {r['vs_first_set']['hidden_bitwise']}, model makespan "
              f"{r['model_makespan_us']:.0f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="on")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--sweep", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8,
                    help="the engine's rows (bench_megakernel.py: 8)")
    ap.add_argument("--no-trace", action="store_true", help="only the sweep")
    ap.add_argument("--dump", action="store_true",
                    help="also $OUT/trace_raw_<tag>.json: every instruction's program, op, "
                         "tile and trace times (raw_rows)")
    args = ap.parse_args()
    import torch

    from photon_core.megakernel import compiler as C
    from photon_core.megakernel.megakernel_backend import resolve_variant
    from photon_core.megakernel.megakernel_step import MegakernelStep
    b = args.b
    c = bm.Ctx(False, max(b, args.max_batch))
    v = resolve_variant(args.variant)
    out: dict = {"gpu": torch.cuda.get_device_name(), "variant": str(v), "b": b,
                 "compiler_constants": {k: getattr(C, k) for k in
                                        ("FILL_SM_BYTES_PER_US", "FILL_INSTR_US",
                                         "ATTN_LATENCY_US", "SM_BYTES_PER_US", "INSTR_US")}}
    c.state_for(b)
    c.fused_step(b, False)
    s0 = c.snap()
    ref = bm._greedy(c, b, args.steps, lambda: c.fused_step(b, False))
    c.restore(s0)
    elsize = c.fd.x.element_size()

    def measure(tag: str):
        mk = MegakernelStep(c.fd, c.st, b, variant=v)

        def step(**kw):
            mk.feed()
            mk.run_kernel(**kw)
        c.restore(s0)
        r = {"greedy": bm._agreement(ref, bm._greedy(c, b, args.steps, step))}
        c.state_for(b, active=False)
        g = bm._graph(torch, step)
        r["graph_ms"] = bm._timed(torch, g.replay)
        del g
        t, trace = median_trace(step, len(mk.compiled.instrs), args.launches, c.dev, c.sync,
                                cols=5)
        r["traced_launch_ms"] = bm._timed(torch, lambda: step(trace=trace))
        r["untraced_launch_ms"] = bm._timed(torch, step)
        a = analyze(mk.compiled, t[:, 0].tolist(), t[:, 4].tolist(), mk.low.shape, elsize)
        if args.dump and os.environ.get("OUT"):
            Path(os.environ["OUT"], f"trace_raw_{tag.replace(' ', '_')}.json").write_text(
                json.dumps(raw_rows(mk.compiled, t)))
        r["trace"] = {k: x for k, x in a.items() if not k.startswith("_")}
        r["gemv_phases_us"] = gemv_phases(mk.compiled, t, a["_stall"])
        if not mk.hybrid:
            r["layer_timeline_us"] = layer_timeline(mk.compiled, t[:, 0].tolist(),
                                                    t[:, 4].tolist())
            for k, x in r["layer_timeline_us"].items():
                print(f"[{tag}]   layer {k}: " + ", ".join(f"{m} {v}" for m, v in x.items()),
                      flush=True)
        print(f"[{tag}] graph {r['graph_ms']:.4f} ms, launch {r['untraced_launch_ms']:.4f} "
              f"(traced {r['traced_launch_ms']:.4f}), tokens {r['greedy']['tokens_equal']}/"
              f"{r['greedy']['tokens_total']}; traced makespan {a['makespan_us']:.1f} us "
              f"(model {a['model_makespan_us']:.1f}); per program: "
              + ", ".join(f"{k} {x:.1f}" for k, x in a["mean_program"].items()), flush=True)
        print_kinds(tag, a)
        for name, k in r["gemv_phases_us"].items():
            print(f"[{tag}]   {name} phases, us per instruction ({k['n']}): to ready "
                  f"{k['to_ready']} (stall {k['stall']}), LayerNorm {k['ln']}, tile "
                  f"{k['tile']}, end {k['end']}", flush=True)
        return mk, a, r

    if args.sweep is not None:
        out["sweep"] = sweep(c, b, v, args, s0, ref)
    if args.no_trace:
        args.calibrate = False
    else:
        mk, a, out["model"] = measure("model")
    if args.calibrate:
        fit = fit_costs(mk.compiled, a, mk.low.shape, elsize, v.per_sm if v.fill else 1)
        out["fitted_constants"] = fit
        print("fitted:", fit, flush=True)
        with compiler_constants(fit):
            out["fitted"] = measure("fitted")[2]
        # the model's schedule again, after: drift between the two
        out["model_again_graph_ms"] = measure("model again")[2]["graph_ms"]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trace_megakernel.json").write_text(
            json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
