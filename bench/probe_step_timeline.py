"""One fused decode step's kernels laid out in time (H200, Moondream 2 at real shapes, random
bf16 weights, megakernel off): a graph replay of the forward piece at batch b, rows at
--pos, profiled (torch profiler / CUPTI), for each module switch setting given: per kernel
name its launches and summed time, and one layer's kernels (the --layer-th LayerNorm to
the next) with start / end relative to that LayerNorm's start and the stream each ran on -
what runs beside what (fast/parallel_branch.py's fork), and where the layer's time goes.

Usage (H200): PYTHONPATH=. python3 bench/probe_step_timeline.py [--batches 1,8] [--pos 300]
                  [--layer 10] [--set photon_core.fast.parallel_branch:MODE=off
                   --set photon_core.fast.parallel_branch:MODE=side]
Writes $OUT/probe_step_timeline.json when OUT is set.
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

from bench.ab_switch import apply_switches  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def profile_forward(fe, b: int, pos: int) -> list[dict]:
    """The CUDA kernels of one replay of the forward graph at batch b: [{name, start, end,
    stream}] in us, sorted by start."""
    from torch.profiler import ProfilerActivity, profile
    fe.state.active.zero_()
    fe.state.pos.fill_(pos)
    for _ in range(3):
        fe.runner.run("forward", b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fe.runner.run("forward", b)
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        out.append(dict(name=ev.name, start=ev.time_range.start, end=ev.time_range.end,
                        stream=getattr(ev, "device_resource_id", -1)))
    return sorted(out, key=lambda e: e["start"])


def layer_window(evs: list[dict], layer: int) -> list[dict]:
    """The kernels from the layer-th LayerNorm launch to the next one."""
    ln = [i for i, e in enumerate(evs) if "layer_norm" in e["name"] or "layernorm" in
          e["name"].lower()]
    if len(ln) <= layer + 1:
        return []
    return evs[ln[layer]:ln[layer + 1] + 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--pos", type=int, default=300)
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE",
                    help="one engine per --set (none: the defaults)")
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model("moondream2")
    res = {}
    for spec in args.set or [""]:
        if spec:
            apply_switches([spec])
        fe = FastEngine(model, max_batch=max(batches), kv_capacity=1024, megakernel="off")
        res[spec] = {}
        for b in batches:
            evs = profile_forward(fe, b, args.pos)
            span = evs[-1]["end"] - evs[0]["start"]
            busy = {}
            for e in evs:
                t = busy.setdefault(e["name"][:70], [0, 0.0])
                t[0] += 1
                t[1] += e["end"] - e["start"]
            win = layer_window(evs, args.layer)
            t0 = win[0]["start"] if win else 0.0
            print(f"{spec or 'defaults'} b={b}: forward span {span:.1f} us, "
                  f"{len(evs)} kernels, summed {sum(v[1] for v in busy.values()):.1f} us")
            for name, (n, us) in sorted(busy.items(), key=lambda kv: -kv[1][1])[:8]:
                print(f"    {us:8.1f} us {n:4d} x  {name}")
            print(f"  layer {args.layer} (us from its LayerNorm's start):")
            for e in win:
                print(f"    {e['start'] - t0:7.2f} -> {e['end'] - t0:7.2f}  "
                      f"({e['end'] - e['start']:6.2f})  s{e['stream']}  {e['name'][:60]}")
            res[spec][b] = dict(span_us=span, kernels=len(evs), per_name=busy,
                                layer=[dict(e, start=e["start"] - t0, end=e["end"] - t0)
                                       for e in win])
        fe.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_step_timeline.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
