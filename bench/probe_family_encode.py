"""Where a 640x480 frame's encode goes for Qwen 3.5 / Gemma 4: the reference encode_image per
stage (host inputs, vision tower, prefix prefill through the reference decoder): the host's
wall time (a device sync at each stage's end) and the GPU kernels' busy time inside it (torch
profiler; under the profiler the kernels run slower, so only the launch counts and the ratio
between stages are meant); then, same process, FastEngine.encode_image (the reference encode
as a CUDA graph per layout: fast/graphed_reference_encoder.py): its wall, and the graph replay
alone (CUDA events).

Real shapes with random bf16 weights (sweep_gemv_family.build_model).

Usage (H200): PYTHONPATH=. python3 bench/probe_family_encode.py [--families qwen3.5-0.8b,gemma4-e2b]
              [--iters 3] [--top 12]
Writes $OUT/probe_family_encode.json when OUT is set.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_timing import call_times  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def stages_of(family: str, model) -> list[tuple[object, str, str]]:
    """(owner, attribute, stage name) of the functions an encode calls, in order."""
    if family.startswith("qwen3.5"):
        from photon_core.models.qwen3_5 import decoder, model as qm, vision
        # the host part is encode_inputs (decode); the resize and the patches are made on
        # the device (image_processor.patches_torch, called through the model module)
        return [(model, "encode_inputs", "host inputs (CPU)"),
                (qm, "patches_torch", "patches (device)"), (vision, "encode", "vision tower"),
                (decoder, "forward", "prefix prefill")]
    from photon_core.models.gemma4 import text, vision as gv
    return [(model, "encode_inputs", "host inputs (CPU)"),
            (gv, "patches_torch", "patches (device)"),
            (model, "image_embeddings", "vision tower"),
            (text, "prefix_kv", "prefix prefill")]


@contextlib.contextmanager
def timed_stages(stages, walls: dict):
    """Wrap each stage function: a record_function range and a synced wall time."""
    saved = []
    for owner, attr, name in stages:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrapped(*a, _fn=fn, _name=name, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with record_function("stage:" + _name):
                out = _fn(*a, **k)
                torch.cuda.synchronize()
            walls.setdefault(_name, []).append((time.perf_counter() - t0) * 1e3)
            return out
        setattr(owner, attr, wrapped)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def kernel_busy(prof) -> dict:
    """GPU kernel time (us) whose start falls inside each stage's CPU range."""
    evs = prof.events()
    ranges = [(ev.name[6:], ev.time_range.start, ev.time_range.end) for ev in evs
              if ev.name.startswith("stage:")]
    busy = {name: 0.0 for name, _, _ in ranges}
    launches = {name: 0 for name, _, _ in ranges}
    for ev in evs:
        if ev.device_type.name != "CUDA":
            continue
        for name, t0, t1 in ranges:
            if t0 <= ev.time_range.start <= t1:
                busy[name] += ev.time_range.elapsed_us()
                launches[name] += 1
                break
    return {n: {"kernel_ms": round(busy[n] / 1e3, 3), "launches": launches[n]} for n in busy}


def encoder_times(fe, frame, iters: int, top: int, label: str) -> dict:
    """FastEngine.encode_image's wall (min of iters, synced) and its graph's replay alone
    (CUDA events); top > 0: the replay's top kernels printed."""
    walls, replay = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fe.encode_image(frame)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    e = next(iter(getattr(fe.encoder, "entries", {}).values()), None)
    if e is not None and e.graph is not None:
        replay = call_times(e.graph.replay, "cuda", iters, warmup=0)
        if top:
            from bench.probe_encode import kernel_times
            rows = kernel_times(e.graph.replay)
            print(f"{label}: graph replay kernels {sum(r[1] for r in rows):.2f} ms in "
                  f"{sum(r[2] for r in rows)} launches; top:")
            for name, ms, n in rows[:top]:
                print(f"    {ms:8.3f} ms {n:5d} x  {name[:90]}")
    return {"encode_ms": round(min(walls), 2),
            "replay_ms": round(min(replay), 2) if replay else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3.5-0.8b,gemma4-e2b")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=0,
                    help="print the graph replay's top kernels by summed time")
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = {"gpu": torch.cuda.get_device_name(), "families": {}}
    for fam in args.families.split(","):
        model = build_model(fam)
        fe = FastEngine(model, max_batch=1, kv_capacity=2048, megakernel="off",
                        encoder="reference")
        fast = FastEngine(model, max_batch=1, kv_capacity=2048, megakernel="off",
                          encoder="fast")
        for _ in range(2):
            fe.encode_image(frame)                 # warm (allocator, cuDNN / cuBLAS picks)
            fast.encode_image(frame)
            model.encode_image(frame)
        walls: dict = {}
        totals = []
        with timed_stages(stages_of(fam, model), walls):
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.encode_image(frame)
                torch.cuda.synchronize()
                totals.append((time.perf_counter() - t0) * 1e3)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.encode_image(frame)
        busy = kernel_busy(prof)
        forms = {"graphed": encoder_times(fe, frame, args.iters, args.top, fam)}
        if fast.encoder is not None and fast.encoder.body != model.encode_body:
            # the family's fast encode body (Gemma 4: vision_fast.py)
            forms["fast"] = encoder_times(fast, frame, args.iters, args.top, fam + " fast")
        res = {"reference_encode_ms": round(min(totals), 2), "engine": forms, "stages": {}}
        for name, ws in walls.items():
            res["stages"][name] = {"wall_ms": round(min(ws[:args.iters]), 2), **busy.get(name, {})}
        out["families"][fam] = res
        print(f"{fam}: reference encode {res['reference_encode_ms']} ms (min of {args.iters}, "
              f"stages synced); FastEngine.encode_image: " + "; ".join(
                  f"{k} {v['encode_ms']} ms (graph replay {v['replay_ms']} ms)"
                  for k, v in forms.items()))
        for name, r in res["stages"].items():
            print(f"    {name:18s} wall {r['wall_ms']:8.2f} ms  kernels {r.get('kernel_ms', 0):8.2f} ms"
                  f"  launches {r.get('launches', 0)}", flush=True)
        fe.close()
        fast.close()
        del fe, fast, model
        torch.cuda.empty_cache()
    write_json("probe_family_encode.json", out)


if __name__ == "__main__":
    main()
