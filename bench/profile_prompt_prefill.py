"""Where the task prompt's prefill goes on the GPU (issue 13's encode + detect(5)), and the
prefill attention's forms against each other in the same run: the prompt of T tokens after a
640x480 frame's 730-token image prefix, as the runtime runs it (graphed_prefill.py: the fused
backend's bucket graph), against its floor (the decoder weights once at copy bandwidth).

Moondream 2 shapes, random bf16 weights, FastEngine(max_batch=4, megakernel=...). For each
form "TOKENS/WARPS[/ROWS]" of decode_attention's prefill (PREFILL_TOKENS tokens per program,
0 = one program per token; PREFILL_WARPS; ROWS: parallel_branch.MAX_ROWS, the passes that run
fc1 beside the attention - 16: the prompt's too) the prefill graphs are captured again, then
per bucket:
graph replay ms (CUDA events, median of 20), the kernels of the replays from the profiler by
name in us per prefill (their sum vs the replay = the launch gaps), the last hidden state's
max |difference| to the first form's; then encode + detect(5) / + query(32) end to end
(bench_decode.e2e, median of --iters) with each form, alternating --rounds times.

Usage: PYTHONPATH=. python3 bench/profile_prompt_prefill.py [--buckets 8,16]
           [--forms 0/2,16/4] [--forms 16/4/4,16/4/16] [--megakernel auto] [--iters 10]
           [--rounds 2] [--top 8]
Writes $OUT/profile_prompt_prefill.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_decode import copy_bandwidth, cuda_ms, decoder_weight_bytes, e2e  # noqa: E402
from profile_fused_step import kernel_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--buckets", default="8,16")
    ap.add_argument("--forms", default="0/2,16/4",
                    help="PREFILL_TOKENS/PREFILL_WARPS per form, the first the baseline")
    ap.add_argument("--megakernel", default="auto")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    import torch
    import photon_core.ops.decode_attention as DA
    from photon_core.fast import FastEngine, parallel_branch
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.model import build_random_model
    from photon_core.task import Task

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    fe = FastEngine(m, max_batch=4, megakernel=args.megakernel)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    prefix = fe.encode_image(frame)
    floor = decoder_weight_bytes(m) / copy_bandwidth() * 1e3
    forms = [tuple(int(x) for x in f.split("/")) for f in args.forms.split(",")]
    rows0 = parallel_branch.MAX_ROWS
    tasks = {"detect5": Task("detect", object="person", max_objects=5),
             "query32": Task("query", question="What is in the image?", max_tokens=32)}
    out = {"gpu": torch.cuda.get_device_name(), "floor_ms": floor,
           "megakernel": args.megakernel, "forms": {}, "e2e": {}}

    def use(form):
        DA.PREFILL_TOKENS, DA.PREFILL_WARPS = form[:2]
        parallel_branch.MAX_ROWS = form[2] if len(form) > 2 else rows0
        fe.prefill.graphs = {}
        fe.prefill.capture()

    first_hidden = {}
    for form in forms:
        use(form)
        name = "/".join(str(x) for x in form)
        res = out["forms"][name] = {}
        for T in [int(b) for b in args.buckets.split(",")]:
            start = fe.kv.load_prefix(0, prefix)
            prompt = list(range(100, 100 + T))

            def run():
                fe.prefill.run(0, start, prompt, prefix.position_offset)
            run()
            hidden = fe.prefill.hidden_out.float().clone()
            ref = first_hidden.setdefault(T, hidden)
            ms = cuda_ms(run)
            table = kernel_table(run)
            total = sum(table.values())
            diff = (hidden - ref).abs().max().item()
            res[T] = {"replay_ms": ms, "kernel_us": total, "hidden_max_diff": diff,
                      "kernels": table}
            print(f"form {name} T={T}: replay {ms:.4f} ms ({ms / floor:.2f}x the weights' "
                  f"floor {floor:.4f}), kernels {total / 1e3:.4f} ms (gaps "
                  f"{ms - total / 1e3:.4f}); last hidden max |diff| vs form "
                  f"{args.forms.split(',')[0]}: {diff:.3g}", flush=True)
            for kname, us in list(table.items())[:args.top]:
                print(f"    {us:8.1f} us  {kname[:100]}", flush=True)
    for rnd in range(args.rounds):
        for form in forms:
            use(form)
            name = "/".join(str(x) for x in form)
            for tname, task in tasks.items():
                r = e2e(fe, frame, task, args.iters)
                out["e2e"].setdefault(name, {}).setdefault(tname, []).append(r)
                print(f"round {rnd} form {name} {tname}: {r['ms']:.3f} ms (encode "
                      f"{r['encode_ms']:.3f}, steps {r['steps']})", flush=True)
    fe.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_prompt_prefill.json").write_text(
            json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
