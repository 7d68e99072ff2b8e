"""Where the host's time goes in one call run(frame, task), unprofiled (issue 13's encode +
detect(5) <= 30 ms): the GPU waits for the host until the frame's upload is queued, so
every microsecond of host work before it is latency. Wraps the functions of the call's path
with perf_counter timers (no CUDA profiler: CUPTI inflates graph launches) and, per call,
records when each was entered and left relative to run()'s entry; prints their mean
inclusive host ms and mean first entry / exit offsets over --calls calls.

Moondream 2 shapes, random bf16 weights, FastEngine(max_batch=4, megakernel=--megakernel).
Usage (GPU): PYTHONPATH=. python3 bench/probe_call_host.py [--tasks detect5] [--calls 20]
Writes $OUT/probe_call_host.json when OUT is set.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.e2e_timeline import TASKS  # noqa: E402
from bench.out_dir import write_json  # noqa: E402


def targets():
    """(owner, attribute, label) of the functions timed."""
    import photon_core.engine_conveniences as ec
    from photon_core.fast import cuda_graph_runner as cgr
    from photon_core.fast import fast_engine, fast_run, graphed_batch_encoder as gbe
    from photon_core.fast import pipelined_decoder as pd
    return [(ec.EngineConveniences, "run", "run"),
            (fast_engine.FastEngine, "start", "start"),
            (fast_engine.FastEngine, "encode_image", "encode_image"),
            (gbe.GraphedBatchEncoder, "encode_batch", "encode_batch"),
            (gbe.GraphedBatchEncoder, "_load", "load (sync, copy to pinned, upload)"),
            (gbe.GraphedBatchEncoder, "_run", "encoder _run"),
            (cgr.GraphParts, "replay", "encode graph parts replay"),
            (fast_run.FastRun, "__init__", "FastRun init"),
            (fast_run.FastRun, "_prefill", "FastRun _prefill"),
            (pd.PipelinedDecoder, "launch", "decoder launch"),
            (pd.PipelinedDecoder, "commit", "decoder commit"),
            (gbe, "to_rgb_array", "to_rgb_array"),
            (gbe, "pixel_layout", "pixel_layout"),
            (gbe.GpuTiming, "start_event", "GpuTiming.start_event"),
            (np, "copyto", "np.copyto"),
            (torch.cuda.Event, "synchronize", "Event.synchronize"),
            (torch.cuda.Event, "record", "Event.record"),
            (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")]


class Recorder:
    def __init__(self):
        self.t0 = None
        self.events: list[tuple[str, float, float]] = []

    def wrap(self, owner, attr, label):
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
        fn = getattr(owner, attr)
        rec = self

        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            if label == "run":
                rec.t0 = t
            try:
                return fn(*a, **kw)
            finally:
                if rec.t0 is not None:
                    rec.events.append((label, t - rec.t0, time.perf_counter() - rec.t0))
        setattr(owner, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        return raw if isinstance(raw, staticmethod) else fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="detect5")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--megakernel", default="on")
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.model import build_random_model

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    fe = FastEngine(m, max_batch=4, megakernel=args.megakernel)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = {"gpu": torch.cuda.get_device_name()}
    for name in args.tasks.split(","):
        task = TASKS[name]
        for _ in range(3):
            fe.run(frame, task, ignore_eos=True)
        torch.cuda.synchronize()
        rec = Recorder()
        originals = [(o, a, rec.wrap(o, a, lab)) for o, a, lab in targets()]
        walls = []
        try:
            per_call = []
            for _ in range(args.calls):
                rec.events.clear()
                torch.cuda.synchronize()
                t = time.perf_counter()
                fe.run(frame, task, ignore_eos=True)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
                per_call.append(list(rec.events))
        finally:
            for o, a, fn in originals:
                setattr(o, a, fn)
        stats: dict[str, dict] = {}
        for events in per_call:
            seen: dict[str, dict] = {}
            for label, t_in, t_out in events:
                s = seen.setdefault(label, {"ms": 0.0, "n": 0, "first_in": t_in,
                                            "first_out": t_out})
                s["ms"] += (t_out - t_in) * 1e3
                s["n"] += 1
            for label, s in seen.items():
                a = stats.setdefault(label, {"ms": 0.0, "n": 0, "first_in_ms": 0.0,
                                             "first_out_ms": 0.0})
                a["ms"] += s["ms"] / len(per_call)
                a["n"] += s["n"] / len(per_call)
                a["first_in_ms"] += s["first_in"] * 1e3 / len(per_call)
                a["first_out_ms"] += s["first_out"] * 1e3 / len(per_call)
        res = {"wall_ms_mean": round(sum(walls) / len(walls), 3),
               "wall_ms_min": round(min(walls), 3),
               "functions": {k: {f: round(v, 3) for f, v in s.items()}
                             for k, s in sorted(stats.items(),
                                                key=lambda kv: kv[1]["first_in_ms"])}}
        out[name] = res
        print(f"{name}: one call {res['wall_ms_mean']} ms (min {res['wall_ms_min']})")
        print("| function | host ms per call (inclusive) | calls | first entry ms "
              "| first exit ms |")
        print("|---|---|---|---|---|")
        for k, s in res["functions"].items():
            print(f"| {k} | {s['ms']} | {s['n']} | {s['first_in_ms']} | {s['first_out_ms']} |")
    fe.close()
    write_json("probe_call_host.json", out)


if __name__ == "__main__":
    main()
