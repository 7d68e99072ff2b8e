"""The task's prompt prefilled in the encode's own prefix pass (EngineOptions.prompt_in_encode,
models/moondream2/prefix_prefill.py prompt_rows) against the prompt prefill after the encode,
same process: Moondream 2 shapes, random bf16 weights, FastEngine defaults otherwise.

  1. the image-prefix prefill alone (fused form, CUDA graphs of `--calls` prefills): 730 rows
     (k/v only, the runtime's encode without a prompt) vs 730 + PROMPT_ROWS rows with the
     prompt rows' last layer; and the runtime's prompt prefill of the task's prompt alone
     (GraphedPrefill.run, CUDA events);
  2. end to end: run(frame, task) wall time (host, synchronized) of a 640x480 frame, the two
     engines alternating, `--runs` per round, min and median; outputs compared.

Usage (H200): PYTHONPATH=. python3 bench/ab_prompt_in_encode.py [--tasks detect5,query32]
              [--rounds 3] [--runs 5] [--megakernel auto]
Writes $OUT/ab_prompt_in_encode.json when OUT is set.
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

from bench.bench_timing import graph_ms  # noqa: E402
from bench.e2e_timeline import TASKS  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.fast.graphed_batch_encoder import PROMPT_ROWS  # noqa: E402
from photon_core.models.moondream2 import batched_encode, text  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402


def prefill_costs(m, fe, prompt, calls: int, rows: int) -> dict:
    w, t = m.weights, m.config.text
    P = m.prefix_len
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, P, t.dim, device="cuda", dtype=w.dtype, generator=g)
    ids = torch.zeros(1, rows, dtype=torch.long, device="cuda")
    ids[0, :len(prompt)] = torch.tensor(prompt)
    xp = torch.cat([x, text.embed(w, ids)], dim=1)
    kv0, kv1 = batched_encode.kv_buffer(m, 1), batched_encode.kv_buffer(m, 1, rows)
    with torch.inference_mode():
        plain = graph_ms(lambda: prefill_prefix(w, t, x, kv0, P, fast=True, hidden=False),
                         calls=calls)
        with_prompt = graph_ms(lambda: prefill_prefix(w, t, xp, kv1, P, fast=True,
                                                      prompt_rows=rows), calls=calls)
        # the runtime's prompt prefill of this prompt (its graph), after a loaded prefix
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(calls):
            ev[0].record()
            fe.prefill.run(0, P, prompt, 0)
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
    return {"prefix_prefill_ms": round(plain, 4),
            "prefix_prefill_with_prompt_rows_ms": round(with_prompt, 4),
            "prompt_rows_cost_ms": round(with_prompt - plain, 4),
            "prompt_prefill_ms": round(min(times), 4), "prompt_tokens": len(prompt)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="detect5,query32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--megakernel", default="auto")
    ap.add_argument("--prompt-rows", type=int, default=PROMPT_ROWS,
                    help="the encoder's prompt rows (graphed_batch_encoder.PROMPT_ROWS)")
    args = ap.parse_args()
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    engines = {on: FastEngine(m, max_batch=4, megakernel=args.megakernel, prompt_in_encode=on)
               for on in (False, True)}
    engines[True].batch_encoder.prompt_rows = args.prompt_rows
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out: dict = {"gpu": torch.cuda.get_device_name(), "megakernel": args.megakernel,
                 "prompt_rows": args.prompt_rows, "tasks": {}}
    for name in args.tasks.split(","):
        task = TASKS[name]
        prompt = m.tokenizer.prompt(task.skill, task.target)
        res = {"prefill": prefill_costs(m, engines[False], prompt, args.calls,
                                        args.prompt_rows)}
        print(name, json.dumps(res["prefill"]), flush=True)
        outs = {}
        for on, fe in engines.items():            # warm: graph captures of both
            for _ in range(3):
                outs[on] = fe.run(frame, task, ignore_eos=True)
        walls = {False: [], True: []}
        for _ in range(args.rounds):
            for on, fe in engines.items():
                for _ in range(args.runs):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    r = fe.run(frame, task, ignore_eos=True)
                    torch.cuda.synchronize()
                    walls[on].append((time.perf_counter() - t0) * 1e3)
                    outs[on] = r
        for on in (False, True):
            res["prompt_in_encode" if on else "prompt_prefill"] = {
                "min_ms": round(min(walls[on]), 3),
                "median_ms": round(statistics.median(walls[on]), 3),
                "tokens": outs[on].tokens}
        res["speedup_min"] = round(min(walls[False]) / min(walls[True]), 4)
        res["outputs_equal"] = outs[True].output == outs[False].output
        res["prompts_taken"] = engines[True].batch_encoder.counts["prompts"]
        out["tasks"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "prefill"}), flush=True)
    for fe in engines.values():
        fe.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "ab_prompt_in_encode.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
