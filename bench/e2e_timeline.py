"""Where the wall time of one end-to-end task goes on the GPU (issue 13's encode + detect(5)
<= 30 ms): one 640x480 encode + task run under the profiler, the GPU's kernel intervals
merged into busy time, the idle gaps between them (with the kernels on each side and which
part of the run they fall in), and the busy time per kind of kernel.

Moondream 2 shapes, random bf16 weights, FastEngine defaults but the megakernel: off unless
--megakernel auto / on (or --deterministic). A few warm runs first (graph captures), then one profiled run of
run(encode_image(frame), task); wall = the host's time for the whole call, also unprofiled
(5 runs) and as the one call run(frame, task) (the encode not waited for).

Usage: PYTHONPATH=. python3 bench/e2e_timeline.py [--tasks detect5,query32] [--gaps 12]
       [--set photon_core.fast.pipelined_decoder:SKIP_FINAL_FORWARD=0]
       [--megakernel on] [--deterministic] [--host-profile 30] [--profile-one-call] [--top 20]
       [--dump]   (every GPU interval of the profiled call to $OUT/e2e_kernels_<task>.json;
                   "idle_by_next_kernel": the idle time summed by the kernel that ends it)
       [--ab MODULE:NAME=VALUE [--ab-rounds 4]]
       [--family qwen3.5-0.8b --tasks query32]   (another family's real shapes, random weights:
       sweep_gemv_family.build_model)
Writes $OUT/e2e_timeline.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.out_dir import write_json  # noqa: E402
from bench.probe_encode import kind_of  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.task import Task  # noqa: E402

TASKS = {"detect5": Task("detect", object="person", max_objects=5),
         "point5": Task("point", object="cup", max_objects=5),
         "query32": Task("query", question="What is in the image?", max_tokens=32),
         "query128": Task("query", question="What is in the image?", max_tokens=128)}


def kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel / memset / memcpy, by start."""
    return sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type.name == "CUDA")


def timeline(ks: list, n_gaps: int) -> dict:
    """Busy (union of intervals) and the idle gaps between the first and the last kernel
    (each with the kernel that ended last before it and the one that starts it)."""
    busy, gaps = 0.0, []
    cur0, cur1, end_name = ks[0]
    for t0, t1, name in ks[1:]:
        if t0 > cur1:
            busy += cur1 - cur0
            gaps.append((t0 - cur1, cur1 - ks[0][0], end_name, name))
            cur0, cur1, end_name = t0, t1, name
        elif t1 > cur1:
            cur1, end_name = t1, name
    busy += cur1 - cur0
    span = cur1 - ks[0][0]
    by_kind: dict[str, float] = {}
    for t0, t1, name in ks:
        k = kind_of(name)
        by_kind[k] = by_kind.get(k, 0.0) + (t1 - t0)
    by_next: dict[str, list] = {}
    for g, _, _, nxt in gaps:
        e = by_next.setdefault(nxt[:48], [0.0, 0])
        e[0] += g
        e[1] += 1
    gaps.sort(reverse=True)
    return {"idle_by_next_kernel": [[k, round(v[0], 1), v[1], round(v[0] / v[1], 2)]
                                    for k, v in sorted(by_next.items(),
                                                       key=lambda kv: -kv[1][0])[:12]],
            "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round((span - busy) / 1e3, 3), "kernels": len(ks),
            "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
            "idle_in_gaps_over_20us_ms": round(sum(g[0] for g in gaps if g[0] > 20) / 1e3, 3),
            "kernel_ms_by_kind": {k: round(v / 1e3, 3) for k, v in sorted(by_kind.items())},
            "largest_gaps": [{"us": round(g, 1), "at_ms": round(at / 1e3, 3),
                              "after": a[:70], "before": b[:70]}
                             for g, at, a, b in gaps[:n_gaps]]}


def top_kernels(ks: list, n: int) -> list:
    """The n kernel names with the most GPU time: [name, ms, launches]."""
    tot: dict[str, list] = {}
    for t0, t1, name in ks:
        e = tot.setdefault(name, [0.0, 0])
        e[0] += t1 - t0
        e[1] += 1
    best = sorted(tot.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name[:90], round(ms / 1e3, 3), cnt] for name, (ms, cnt) in best]


def host_profile(fn, top: int) -> list[str]:
    """cProfile of one call (the host's side: GPU work runs ahead of it, a synchronizing
    call shows as its wait): the `top` functions by cumulative and by own time."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    lines = []
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
        lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()][-top - 1:]
    return lines


def ab_one_call(fe, frame, task, spec: str, rounds: int, runs: int = 10,
                ignore_eos: bool = True, on_result=None, sync=None) -> dict:
    """The one call run(frame, task) with the switch "module:NAME=VALUE" off (its value in
    the run) and on, in one process: `rounds` rounds, each setting `runs` calls (after one
    untimed) per round, alternating; {setting: [mean ms per round]}. frame: an image or an
    encoded one; on_result(setting, result): each round's last result; sync: the device
    sync (default torch.cuda.synchronize)."""
    from ab_switch import parse_toggle
    sync = sync or torch.cuda.synchronize
    mod, attr, value = parse_toggle(spec)
    before = getattr(mod, attr)
    out: dict = {f"{attr}={before}": [], f"{attr}={value}": []}
    try:
        for _ in range(rounds):
            for v in (before, value):
                setattr(mod, attr, v)
                fe.run(frame, task, ignore_eos=ignore_eos)
                sync()
                t0 = time.perf_counter()
                for _ in range(runs):
                    r = fe.run(frame, task, ignore_eos=ignore_eos)
                sync()
                out[f"{attr}={v}"].append(round((time.perf_counter() - t0) / runs * 1e3, 3))
                if on_result is not None:
                    on_result(f"{attr}={v}", r)
    finally:
        setattr(mod, attr, before)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="detect5,query32")
    ap.add_argument("--gaps", type=int, default=12)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--megakernel", default="off")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--family", default="moondream2",
                    help="moondream2 | qwen3.5-0.8b | gemma4-e2b (... sweep_gemv_family)")
    ap.add_argument("--option", action="append", default=[],
                    help="NAME=VALUE: an EngineOptions field (ab_switch's form), repeatable")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE",
                    help="a module switch for the whole run (ab_switch.parse_toggle's form)")
    ap.add_argument("--profile-one-call", action="store_true",
                    help="profile run(frame, task) (the encode not waited for) instead of "
                         "run(encode_image(frame), task)")
    ap.add_argument("--top", type=int, default=0, metavar="N",
                    help="also list the N kernels of the profiled call by total time "
                         "(name, ms, launches)")
    ap.add_argument("--ab", default="", metavar="MODULE:NAME=VALUE",
                    help="also the one call with this switch against its value in the run, "
                         "alternating in this process (ab_one_call)")
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--dump", action="store_true",
                    help="write every profiled GPU interval to $OUT/e2e_kernels_<task>.json")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also cProfile one run: the N functions by cumulative / own time")
    args = ap.parse_args()
    from ab_switch import apply_switches
    apply_switches(args.set)
    if args.family == "moondream2":
        m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    else:
        from sweep_gemv_family import build_model
        m = build_model(args.family)
    from ab_switch import _option
    opts = {k: v for spec in args.option for k, v in _option(spec).items()}
    fe = FastEngine(m, max_batch=4, deterministic=args.deterministic,
                    megakernel=args.megakernel, **opts)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out: dict = {"gpu": torch.cuda.get_device_name(), "family": args.family,
                 "megakernel": args.megakernel, "options": args.option, "set": args.set,
                 "deterministic": args.deterministic}
    for name in args.tasks.split(","):
        task = TASKS[name]
        for _ in range(args.warm):      # (in the form that is profiled)
            fe.run(frame if args.profile_one_call else fe.encode_image(frame), task,
                   ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            r = fe.run(frame if args.profile_one_call else fe.encode_image(frame), task,
                       ignore_eos=True)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        ks = kernels(prof)
        res = timeline(ks, args.gaps)
        if args.dump:           # every GPU interval: [start us from the first, us, name];
            #                     the host's CUDA API calls the same way (host clock = the
            #                     profiler's common clock)
            write_json(f"e2e_kernels_{name}.json",
                       [[round(a - ks[0][0], 2), round(b - a, 2), n[:80]] for a, b, n in ks])
            api = sorted((ev.time_range.start, ev.time_range.end, ev.name)
                         for ev in prof.events() if ev.device_type.name == "CPU"
                         and ev.name.startswith("cuda"))
            write_json(f"e2e_host_api_{name}.json",
                       [[round(a - ks[0][0], 2), round(b - a, 2), n[:60]] for a, b, n in api])
        if args.top:
            res["top_kernels"] = top_kernels(ks, args.top)
        res["wall_ms_profiled"] = round(wall, 3)
        res["tokens"] = r.tokens if isinstance(r.tokens, int) else len(r.tokens)
        t0 = time.perf_counter()
        for _ in range(5):
            fe.run(fe.encode_image(frame), task, ignore_eos=True)
        torch.cuda.synchronize()
        res["wall_ms_unprofiled"] = round((time.perf_counter() - t0) / 5 * 1e3, 3)
        # the one call: start() of the image queues the prefill behind the encode (no wait)
        fe.run(frame, task, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            r1 = fe.run(frame, task, ignore_eos=True)
        torch.cuda.synchronize()
        res["wall_ms_one_call"] = round((time.perf_counter() - t0) / 5 * 1e3, 3)
        res["one_call_output_equal"] = r1.output == r.output
        if args.ab:
            res["ab_one_call_ms"] = ab_one_call(fe, frame, task, args.ab, args.ab_rounds)
        if args.host_profile:
            res["host_profile"] = host_profile(lambda: fe.run(fe.encode_image(frame), task,
                                                              ignore_eos=True),
                                               args.host_profile)
        res["profiled"] = "run(frame, task)" if args.profile_one_call else \
            "run(encode_image(frame), task)"
        out[name] = res
        print(json.dumps({name: {k: v for k, v in res.items() if k != "host_profile"}}),
              flush=True)
        for line in res.get("host_profile", []):
            print(f"{name} host | {line[:150]}", flush=True)
    fe.close()
    write_json("e2e_timeline.json", out)


if __name__ == "__main__":
    main()
