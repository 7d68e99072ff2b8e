"""The one call run(frame, task) as a robot meets it (issue 13's encode + detect(5) <= 30 ms),
for comparing two trees in one device call (run this file from each tree's root, in turn):
Moondream 2 shapes, random bf16 weights, FastEngine defaults (megakernel "auto"), one 640x480
frame; per task `--rounds` rounds of `--calls` calls (after 3 warm ones), each round's mean
wall ms, and the output's digest, finish reason and steps (equal digests: equal outputs).

Usage (GPU): PYTHONPATH=. python3 bench/one_call.py [--tasks detect5,point5] [--rounds 5]
             [--calls 10] [--ignore-eos 1] [--encoded]
             [--set MODULE:NAME=VALUE]  (a switch set before the engine is built and its
                                         graphs captured; for switches read at capture)
             [--ab MODULE:NAME=VALUE]   (one tree: the switch at VALUE and at its own value,
                                         alternating round by round in this process)
--encoded: the task started from the frame encoded once before (its prompt prefill and
decode steps only).
CPU smoke run (the tiny test model): PYTHONPATH=. python3 bench/one_call.py --tiny
"""
from __future__ import annotations

import argparse
import hashlib
from collections import defaultdict
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ab_switch import parse_toggle  # noqa: E402
from bench.e2e_timeline import TASKS, ab_one_call  # noqa: E402
from bench.probe_gc import build, sync  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="detect5,point5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--ignore-eos", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU")
    ap.add_argument("--encoded", action="store_true",
                    help="start from the frame encoded once (prefill + decode only)")
    ap.add_argument("--ab", default="", metavar="MODULE:NAME=VALUE")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE")
    args = ap.parse_args()
    for spec in args.set:
        mod, attr, value = parse_toggle(spec)
        setattr(mod, attr, value)
        print(json.dumps({"set": f"{attr}={value}"}), flush=True)
    fe, frame, dev = build(args.tiny)
    print(json.dumps({"decode_graphs": len(fe.runner.graphs),
                      "capture_ms": round(fe.runner.capture_ms, 1)}), flush=True)
    eos = bool(args.ignore_eos)
    src = fe.encode_image(frame) if args.encoded else frame
    for name in args.tasks.split(","):
        task = TASKS[name]
        for _ in range(3):
            r = fe.run(src, task, ignore_eos=eos)
        digests, last = defaultdict(set), {}

        def seen(label, result, digests=digests, last=last):
            digests[label].add(hashlib.sha256(
                json.dumps(result.output, sort_keys=True).encode()).hexdigest()[:12])
            last[label] = result
        if args.ab:      # the switch at its value and at VALUE, round by round
            rounds = {f"{name} {k}": v for k, v in ab_one_call(
                fe, src, task, args.ab, args.rounds, args.calls, eos,
                lambda k, res: seen(f"{name} {k}", res), lambda: sync(dev)).items()}
        else:
            rounds = {name: []}
            for _ in range(args.rounds):
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    r = fe.run(src, task, ignore_eos=eos)
                sync(dev)
                rounds[name].append(round((time.perf_counter() - t0) / args.calls * 1e3, 3))
                seen(name, r)
        for label, ms in rounds.items():
            r = last[label]
            print(json.dumps({label: {"round_ms": ms, "mean_ms": round(float(np.mean(ms)), 3),
                                      "output": sorted(digests[label]),
                                      "finish": r.finish_reason, "steps": r.tokens}}),
                  flush=True)

if __name__ == "__main__":
    main()
