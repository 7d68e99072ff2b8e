"""Which source line launches each GPU kernel of a family's encode (Qwen 3.5 by default):
FastEngine.encode_image with the engine's default encoder run eagerly (use_graphs=False - not
as the graph, so the profiler links every kernel to the aten op and the Python line that
issued it), the kernels grouped by (kernel, aten op, the innermost photon_core lines),
longest first. Made to find what launched the two fp32 FFMA GEMMs of Qwen 3.5's encode
(session 15's profile) that the delta rule's TF32 products did not move: the vision
attention (session 16, when the probe ran the model's encode_body_fast directly; the
engine's eager encoder since, not yet run on the device).

Usage (H200): PYTHONPATH=. python3 bench/probe_encode_ops.py [--top 25]
              [--family qwen3.5-0.8b|gemma4-e2b|moondream2]
              [--set photon_core.ops.gated_delta_rule:FAST_SCAN=1]
Writes $OUT/probe_encode_ops.json when OUT is set.
"""
from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.ab_switch import apply_switches  # noqa: E402
from bench.out_dir import write_json  # noqa: E402


class LineRanges(TorchDispatchMode):
    """Every aten op inside a profiler range named "@" + its innermost two photon_core lines
    (the kernels it launches become that range's children)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        lines = [f"{f.filename.split('photon_core/')[-1]}:{f.lineno}"
                 for f in traceback.extract_stack() if "photon_core/" in f.filename][-2:]
        with record_function("@" + " <- ".join(reversed(lines))):
            return func(*args, **(kwargs or {}))


def source_of(ev) -> tuple[str, str]:
    """(the aten op that launched a kernel, the "@" range around it)."""
    op, e = ev.name, ev
    while e is not None and not e.name.startswith("@"):
        e = e.cpu_parent
    return op, (e.name[1:] if e is not None else "?")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3.5-0.8b")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    apply_switches(args.set)
    from sweep_gemv_family import build_model
    from photon_core.fast import FastEngine
    fe = FastEngine(build_model(args.family), max_batch=1, kv_capacity=2048, megakernel="off",
                    use_graphs=False, graphed_encoder=True)   # its encoder's body, eagerly
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    for _ in range(2):
        fe.encode_image(frame)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with LineRanges():
            fe.encode_image(frame)
        torch.cuda.synchronize()
    groups: dict = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    for ev in prof.events():
        for k in ev.kernels:
            op, where = source_of(ev)
            g = groups[(k.name[:70], op, where)]
            g[0] += k.duration / 1e3
            g[1] += 1
            total += k.duration / 1e3
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]
    out = {"family": args.family, "set": args.set, "kernel_ms": round(total, 3),
           "top": [{"kernel": k, "op": op, "where": where, "ms": round(ms, 3), "launches": n}
                   for (k, op, where), (ms, n) in rows]}
    print(f"kernel time {total:.3f} ms (eager, linked to ops)")
    for r in out["top"]:
        print(f"{r['ms']:8.3f} ms {r['launches']:5d} x  {r['kernel'][:60]:60s} {r['op']:28s} "
              f"{r['where']}")
    fe.close()
    write_json("probe_encode_ops.json", out)


if __name__ == "__main__":
    main()
