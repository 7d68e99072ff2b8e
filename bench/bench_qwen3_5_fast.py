"""Qwen 3.5 on the fast path (FastEngine: state cache with DeltaNet row states, CUDA graphs,
pipelined decoding, fused backend) at real 0.8B / 2B shapes with random weights (bf16, GPU),
against the reference engine and the bandwidth floor of bench_qwen3_5.py, in one run:

  - graph replay of one decode step (lm pick + forward) at batch 1 and 8, context --ctx,
    and the CUDA kernels launched per step (torch profiler, as bench/ab_step.py; per layer);
  - the same for the fused backend's previous lowering of the hybrid ops (their torch row
    forms instead of the rows kernels of fast/hybrid_rows.py: the A/B in one run; --no-ab
    skips it);
  - the pipelined loop (wall ms per step, GPU idle per step) at batch 1;
  - a 640x480 frame: encode + query(32 forced tokens), encode + 150 forced tokens (~ the JSON
    of 5 boxes), FastEngine vs the reference engine;
  - agreement: greedy tokens of a 32-token query, fast vs reference (bf16: the first
    divergence, if any, is reported, not asserted).
The hybrid ops (gated attention, conv, delta rule, the norms, the SwiGLU gate) run as the
rows kernels of fast/hybrid_rows.py inside the graphs (decode); prefills keep their torch
references.

Usage (GPU):  PYTHONPATH=. python3 bench/bench_qwen3_5_fast.py [--sizes 0.8b,2b] [--iters 20]
Smoke (CPU):  PYTHONPATH=. python3 bench/bench_qwen3_5_fast.py --smoke
Writes $OUT/bench_qwen3_5_fast.json and .md when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_qwen3_5 as bq  # noqa: E402
from bench import bench_timing  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.models.qwen3_5.image_processor import ImageProcessorConfig  # noqa: E402
from photon_core.models.qwen3_5.model import Qwen35Model  # noqa: E402
from photon_core.task import Task  # noqa: E402

LINES: list[str] = []
QUESTION = "What is in the image?"


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


def graph_step_ms(fe, b, device, iters):
    fe.state.active.zero_()          # inactive rows: replays disturb no row state
    return bq.timed_ms(lambda: (fe.runner.run("lm", b), fe.runner.run("forward", b)), device,
                       iters)


def step_kernels(fe, b, top=0):
    """bench_timing.step_kernels, the top kernels printed with this bench's say."""
    return bench_timing.step_kernels(fe, b, top, say)


def torch_lowering_engine(model, kv):
    """A FastEngine whose fused backend runs the hybrid ops' torch row forms (the lowering
    before fast/hybrid_rows.py): the A/B baseline, built with the rows lowering switched off."""
    from photon_core.fast import fused_backend
    keep = fused_backend.hybrid_rows.RowsLowering
    fused_backend.hybrid_rows.RowsLowering = lambda *a, **k: None
    try:
        return FastEngine(model, max_batch=8, kv_capacity=kv)
    finally:
        fused_backend.hybrid_rows.RowsLowering = keep


def loop_ms(fe, enc, steps=40, warm=4):
    runs = [fe.start(enc, Task("query", question=QUESTION, max_tokens=steps + warm + 8),
                     ignore_eos=True)]
    for _ in range(warm):
        fe.step_batch(runs)
    fe.reset_metrics()
    t0 = time.perf_counter()
    for _ in range(steps):
        fe.step_batch(runs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    m = fe.metrics()
    for r in runs:
        r.cancel()
    fe.drain()
    return wall, m["gpu_idle_per_step"].get("median_ms")


def bench_size(size, device, dtype, args, bw, tok, prompts, results):
    say(f"\n## Qwen3.5-{size} shapes ({dtype}, {device}): fast path")
    hf, cfg, weights = bq.build(size, device, dtype, tok)
    del hf
    model = Qwen35Model(cfg, weights, prompts, ImageProcessorConfig(), f"random-qwen3.5-{size}")
    r = {"size": size, "ctx": args.ctx}
    t0 = time.perf_counter()
    fe = FastEngine(model, max_batch=8, kv_capacity=args.kv)
    r["engine_build_s"] = time.perf_counter() - t0
    r["fused"] = fe.state.fused is not None
    r["graphs"] = fe.metrics()["graphs"]
    floor = bq.step_bytes(cfg, weights, args.ctx) / bw * 1e3 if bw == bw else float("nan")
    for b in (1, 8):
        # rows at position ctx (the graphs attend over the whole capacity with a mask)
        fe.state.pos.fill_(args.ctx)
        r[f"graph_step_ms_b{b}"] = graph_step_ms(fe, b, device, args.iters)
        if torch.cuda.is_available():
            say(f"b={b}: the step's kernels by CUDA time (one replay, profiled):")
        r[f"kernels_per_step_b{b}"] = step_kernels(fe, b, top=12)
    r["floor_ms_b1"] = floor
    n_layers = cfg.text.num_hidden_layers
    r["rows_lowering"] = fe.state.fused is not None and fe.state.fused.rows_lowering is not None
    k1 = r["kernels_per_step_b1"]
    say(f"kernels per step (b=1): {k1} ({k1 / n_layers:.1f} per layer, {n_layers} layers)"
        if k1 is not None else "kernels per step: no CUDA profiler")
    if args.ab:
        old = torch_lowering_engine(model, args.kv)
        for b in (1, 8):
            old.state.pos.fill_(args.ctx)
            r[f"torch_lowering_graph_step_ms_b{b}"] = graph_step_ms(old, b, device, args.iters)
            r[f"torch_lowering_kernels_per_step_b{b}"] = step_kernels(old, b)
        old.close()
        del old
        say(f"A/B: hybrid ops as torch row forms: graph step b=1 "
            f"{r['torch_lowering_graph_step_ms_b1']:.3f} ms, b=8 "
            f"{r['torch_lowering_graph_step_ms_b8']:.3f} ms, kernels per step (b=1) "
            f"{r['torch_lowering_kernels_per_step_b1']}")
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    enc = fe.encode_image(frame)
    r["loop_wall_ms_b1"], r["gpu_idle_ms_b1"] = loop_ms(fe, enc)
    say(f"graph step @cap {args.kv}: b=1 {r['graph_step_ms_b1']:.3f} ms, b=8 "
        f"{r['graph_step_ms_b8']:.3f} ms; floor(ctx {args.ctx}) {floor:.3f} ms; pipelined loop "
        f"b=1 {r['loop_wall_ms_b1']:.3f} ms/step, GPU idle {r['gpu_idle_ms_b1']} ms; fused "
        f"{r['fused']}, {r['graphs']} graphs, built in {r['engine_build_s']:.1f} s")

    def task_ms(engine, n_tokens):
        def go():
            res = engine.run(engine.encode_image(frame), Task("query", question=QUESTION,
                                                              max_tokens=n_tokens),
                             ignore_eos=True) if engine is fe else None
            if engine is not fe:
                run = engine.start(engine.encode_image(frame), Task(
                    "query", question=QUESTION, max_tokens=n_tokens), ignore_eos=True)
                while run.step():
                    pass
                res = run.result()
            assert res.tokens == n_tokens
        return bq.timed_ms(go, device, max(2, args.iters // 4), 1)
    for name, eng in (("fast", fe), ("reference", model)):
        r[f"{name}_encode_query32_ms"] = task_ms(eng, 32)
        r[f"{name}_encode_150tok_ms"] = task_ms(eng, 150)
    say(f"640x480 encode + query(32): fast {r['fast_encode_query32_ms']:.1f} ms, reference "
        f"{r['reference_encode_query32_ms']:.1f} ms; encode + 150 tokens: fast "
        f"{r['fast_encode_150tok_ms']:.1f} ms, reference {r['reference_encode_150tok_ms']:.1f} ms")
    t = Task("query", question=QUESTION, max_tokens=32)
    a = fe.start(enc, t, ignore_eos=True)
    while a.step():
        pass
    fe.drain()
    ref = model.start(enc, t, ignore_eos=True)
    while ref.step():
        pass
    got, want = a.result().output["answer"], ref.result().output["answer"]
    r["answer_equal"] = got == want
    r["first_diff_char"] = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                                None if got == want else min(len(got), len(want)))
    say(f"32-token greedy answer fast == reference: {r['answer_equal']} "
        f"(first differing character {r['first_diff_char']})")
    results.append(r)
    fe.close()
    del fe, model, weights
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bq.add_size_args(ap, "row position of the timed step")
    ap.add_argument("--kv", type=int, default=1024, help="state-cache positions per row")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, fp32")
    ap.add_argument("--no-ab", dest="ab", action="store_false",
                    help="skip the A/B against the hybrid ops' torch row forms")
    args = ap.parse_args(argv)
    device, dtype, sizes = bq.device_dtype_sizes(args)
    if args.smoke:
        args.iters, args.ctx, args.kv = 2, 40, 512
    tok, prompts = bq.bench_prompts()
    bw = bq.copy_bandwidth(device)
    say(f"# bench_qwen3_5_fast ({device}"
        f"{', ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''})")
    results = []
    with torch.inference_mode():
        for size in sizes:
            bench_size(size, device, dtype, args, bw, tok, prompts, results)
    bq.write_out("bench_qwen3_5_fast", bw, results, LINES, default=str)
    return results


if __name__ == "__main__":
    main()
