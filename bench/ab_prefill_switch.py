"""A module switch on Moondream 2's image-prefix prefill (the fused form the runtime's encode
runs: hidden=False, 730 tokens per frame), same process: CUDA graphs of the prefill of 1, 2
and 4 frames with the switch at the baseline's value and at its current one, alternating in
--rounds rounds; the k/v difference between the two forms (relative to the largest |k/v|).

Usage (H200): PYTHONPATH=. python3 bench/ab_prefill_switch.py \
                  --toggle photon_core.models.moondream2.prefix_prefill:MLP_STREAM=0 [--rounds 3]
Writes $OUT/ab_prefill_switch.json when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ab_switch import parse_toggle  # noqa: E402
from bench.bench_timing import graph_ms  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from photon_core.models.moondream2 import batched_encode  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--toggle", required=True, help="MODULE:NAME=VALUE, the baseline's value")
    ap.add_argument("--frames", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="prefills per graph")
    args = ap.parse_args()
    mod, attr, base = parse_toggle(args.toggle)
    now = getattr(mod, attr)
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    w, t = m.weights, m.config.text
    out = {"gpu": torch.cuda.get_device_name(), "toggle": args.toggle, "frames": {}}
    with torch.inference_mode():
        for n in (int(f) for f in args.frames.split(",")):
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn(n, m.prefix_len, t.dim, device="cuda", dtype=w.dtype, generator=g)
            kvs = {k: batched_encode.kv_buffer(m, n) for k in ("baseline", "now")}
            ms = {"baseline": [], "now": []}
            for r in range(args.rounds):
                order = ("baseline", "now") if r % 2 == 0 else ("now", "baseline")
                for label in order:
                    setattr(mod, attr, base if label == "baseline" else now)
                    try:
                        ms[label].append(round(graph_ms(
                            lambda label=label: prefill_prefix(
                                w, t, x, kvs[label], m.prefix_len, fast=True, hidden=False),
                            calls=args.calls), 4))
                    finally:
                        setattr(mod, attr, now)
            diff = ((kvs["now"].float() - kvs["baseline"].float()).abs().max()
                    / kvs["baseline"].float().abs().max()).item()
            res = out["frames"][n] = {"rounds_ms": ms, "kv_rel_diff": diff,
                                      "baseline_ms": min(ms["baseline"]), "now_ms": min(ms["now"])}
            print(f"{n} frame(s): baseline {ms['baseline']} ms, now {ms['now']} ms; "
                  f"min {res['baseline_ms']:.3f} -> {res['now_ms']:.3f} "
                  f"({res['baseline_ms'] / res['now_ms']:.3f}x); k/v rel. diff {diff:.2e}",
                  flush=True)
    write_json("ab_prefill_switch.json", out)


if __name__ == "__main__":
    main()
