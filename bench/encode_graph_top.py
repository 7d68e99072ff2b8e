"""Where the whole 640x480 encode graph's time goes (issue 13), on the GPU: the runtime's encode
graph (FastEngine defaults: crops made inside the graph, vision, projection, prefix prefill)
replayed under the profiler (probe_encode.profile_kinds, mean of 5 replays): kernel time by
kind and the top kernels, with the graph's replay time and the sum of its kernels' times (the
rest: gaps between kernels) from the same run.

Usage: PYTHONPATH=. python3 bench/encode_graph_top.py [--top 25] [--crops overlap|global]
           [--sdpa default|flash|efficient|cudnn]   (the SDPA backend the graph is captured
           with: torch.nn.attention.sdpa_kernel; default = torch's pick)
           [--set photon_core.models.moondream2.vision_fused:ATTENTION=triton:128x64x4x3]
Writes $OUT/encode_graph_top.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cuda_ms  # noqa: E402
from bench.bench_encode import _rel  # noqa: E402
from bench.probe_encode import profile_kinds  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--crops", default="overlap", choices=("overlap", "global"))
    ap.add_argument("--sdpa", default="default", choices=("default", "flash", "efficient",
                                                           "cudnn"))
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE",
                    help="a module switch set before the graph's capture (ab_switch's form)")
    args = ap.parse_args()
    from bench.ab_switch import apply_switches
    apply_switches(args.set)
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}.get(args.sdpa)
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    fe = FastEngine(m)
    with (sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()):
        enc = fe.encode_image(frame, crops=args.crops)        # captures the layout's graph
    entry = next(e for k, e in fe.batch_encoder.entries.items()
                 if len(k) == 1 and k[0].crops == args.crops)
    ref = m.encode_image(frame).kv if args.crops == "overlap" else None
    out = {"gpu": torch.cuda.get_device_name(), "crops": args.crops, "sdpa": args.sdpa,
           "set": args.set,
           "kv_max_rel_diff_vs_reference": None if ref is None else _rel(enc.kv, ref),
           "graph_replay_ms": round(cuda_ms(entry.graph.replay, 20), 3)}
    out.update(profile_kinds(entry.graph.replay, top=args.top, reps=5, key_chars=110))
    print(json.dumps({k: v for k, v in out.items() if k != "top"}, indent=1))
    print("\n| kernel | ms per encode | calls |\n|---|---|---|")
    for name, ms, calls in out["top"]:
        print(f"| {name} | {ms} | {calls} |")
    fe.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "encode_graph_top.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
