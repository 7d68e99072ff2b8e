"""The host's side of queued encodes (FastEngine.encode_image(frame, sync=False): the
scheduler's queued encodes, FastEngine.start of an image) for a family whose encode is a
graphed reference encode (Qwen 3.5, Gemma 4): session 14 found back-to-back queued encodes
holding the host ~12 ms each in the frame's pageable upload, and a 5 ms gap before Qwen's
encode graph started in a one-call run.

  1. n back-to-back encode_image(frame, sync=False), the frame uploaded through pinned memory
     (split_encode.upload_frame, since 77fbb88) and, same process, from pageable memory
     (the form before): host ms per call, the wall until the last encode is done, and the
     GPU's time of the n encodes (their events) - wall minus GPU = idle;
  2. the encode graph's replay() alone (cudaGraphLaunch of its nodes): host ms per call,
     measured with the GPU idle before each call.

Usage (H200): PYTHONPATH=. python3 bench/probe_queued_encode_host.py [--family qwen3.5-0.8b] [--n 5]
Writes $OUT/probe_queued_encode_host.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from photon_core import split_encode  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402


def pageable(array, device):
    """The upload before 77fbb88: from pageable memory."""
    return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)


def back_to_back(fe, frame, n: int) -> dict:
    torch.cuda.synchronize()
    host = []
    t0 = time.perf_counter()
    encs = []
    for _ in range(n):
        t = time.perf_counter()
        encs.append(fe.encode_image(frame, sync=False))
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    gpu = sum(e.gpu_encode_ms() for e in encs)
    return {"host_ms_per_call": [round(h, 3) for h in host], "wall_ms": round(wall, 3),
            "gpu_ms": round(gpu, 3), "idle_ms": round(wall - gpu, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3.5-0.8b")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from sweep_gemv_family import build_model
    m = build_model(args.family)
    fe = FastEngine(m, max_batch=2)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    for _ in range(3):
        fe.encode_image(frame)                  # capture + warm
    fam_mod = sys.modules[type(m).__module__]
    pinned = fam_mod.upload_frame
    out: dict = {"gpu": torch.cuda.get_device_name(), "family": args.family, "n": args.n}
    for rnd in range(args.rounds):
        for name, fn in (("pinned", pinned), ("pageable", pageable)):
            fam_mod.upload_frame = fn
            try:
                res = back_to_back(fe, frame, args.n)
            finally:
                fam_mod.upload_frame = pinned
            out.setdefault(name, []).append(res)
            print(name, json.dumps(res), flush=True)
    (e,) = [x for x in fe.encoder.entries.values() if x.graph is not None][:1]
    ms = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        e.graph.replay()
        ms.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    out["graph_replay_host_ms"] = {"median": round(statistics.median(ms), 3),
                                   "all": [round(v, 3) for v in ms]}
    print("encode graph replay(), host ms:", json.dumps(out["graph_replay_host_ms"]), flush=True)
    assert split_encode.upload_frame is pinned
    fe.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "probe_queued_encode_host.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
