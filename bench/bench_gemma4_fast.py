"""Gemma 4 on the fast path (FastEngine: the step program in the fused backend, CUDA graphs,
pipelined decoding) at E2B shapes with random bf16 weights, against its bandwidth floor, the
reference engine and transformers' eager Gemma4ForConditionalGeneration (the SAME weights),
all in one run:

  - copy bandwidth (device to device) -> the decode floor at batch 1: bytes a step must read
    (bench_gemma4.step_bytes: every text matrix, the tied lm_head, one per-layer embedding
    row, the k/v in the window of every k/v layer) / bandwidth;
  - FastEngine's decode step (lm pick + forward) as CUDA graph replays at batch 1 and 4, rows
    at the position after a 640x480 image prefix + the question; CUDA kernels per step;
  - the reference engine's eager step and transformers' eager step at that position;
  - 640x480 encode + query(32 tokens, ignore_eos): fast vs reference vs transformers
    generate(min_new_tokens=32) on the same pixels; the fast and reference 32-token greedy
    answers compared (bf16: the fused backend keeps an fp32 residual stream, so near-tied
    random logits may part);
  - a pipelined loop of 40 steps at batch 1 (wall ms per step, GPU idle per step).

The per-layer embedding table (E2B: 4.7 GB) stays on the GPU.

Usage (H200, ~2-3 min):  PYTHONPATH=. python3 bench/bench_gemma4_fast.py
CPU smoke (tiny model, fp32, no graphs):  PYTHONPATH=. python3 bench/bench_gemma4_fast.py --smoke
Prints a table; writes $OUT/bench_gemma4_fast.json when OUT is set.
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

from bench.bench_gemma4 import (QUESTION, build, hf_greedy, model_logits,  # noqa: E402
                                step_bytes)
from bench.bench_timing import copy_bandwidth, median_ms, step_kernels  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.models.gemma4.kv_cache import KVCache  # noqa: E402
from photon_core.task import Task  # noqa: E402


def say(s=""):
    print(s, flush=True)


def graph_step_ms(fe, b, pos, device, iters):
    """One decode step (lm pick + forward) of rows [0, b) at `pos`: graph replays on CUDA
    (the rows inactive: replays change no row state), the same pieces eagerly elsewhere."""
    fe.state.active.zero_()
    fe.state.pos.fill_(pos)
    return median_ms(lambda: (fe.runner.run("lm", b), fe.runner.run("forward", b)), device,
                     iters)


def wall_ms(fn, device, reps):
    """Median wall ms of fn() (the device synchronized after each) over reps, one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def loop_ms(fe, enc, steps=40, warm=4):
    run = fe.start(enc, Task("query", question=QUESTION, max_tokens=steps + warm + 8),
                   ignore_eos=True)
    for _ in range(warm):
        fe.step_batch([run])
    fe.reset_metrics()
    t0 = time.perf_counter()
    for _ in range(steps):
        fe.step_batch([run])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    idle = fe.metrics()["gpu_idle_per_step"].get("median_ms")
    run.cancel()
    fe.drain()
    return wall, idle


def greedy_query(engine, enc, n):
    t = Task("query", question=QUESTION, max_tokens=n)
    r = engine.start(enc, t, ignore_eos=True)
    while r.step():
        pass
    if isinstance(engine, FastEngine):
        engine.drain()
    return r.result()


def guarded(out: dict, name: str, fn) -> bool:
    """Run one section; an exception is reported (out[name + "_error"]) and the run goes on
    with the next section (one GPU call must bring back everything it can)."""
    try:
        fn()
        return True
    except Exception as e:          # noqa: BLE001 - reported, not hidden
        import traceback
        traceback.print_exc()
        out[name + "_error"] = f"{type(e).__name__}: {e}"[:400]
        say(f"{name}: FAILED {out[name + '_error']}")
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--kv-shared", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--kv", type=int, default=1024, help="state-cache positions per row")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=0,
                    help="also print the step's top kernels by CUDA time")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "dtype": str(dtype), "smoke": args.smoke}
    t0 = time.perf_counter()
    model, hf = build(args, device, dtype)
    out["build_s"] = time.perf_counter() - t0
    say(f"model built in {out['build_s']:.1f} s ({out['device']}, {dtype})")
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)

    engines: list = []

    def build_engine():
        t0 = time.perf_counter()
        engines.append(FastEngine(model, max_batch=4, kv_capacity=args.kv))
        out["engine_build_s"] = time.perf_counter() - t0
        m = engines[0].metrics()
        out["fused"], out["graphs"] = engines[0].state.fused is not None, m["graphs"]
        out["graph_capture_ms"] = m["graph_capture_ms"]
        say(f"FastEngine built in {out['engine_build_s']:.1f} s: fused {out['fused']}, "
            f"{out['graphs']} graphs")
    guarded(out, "fast_engine", build_engine)
    fe = engines[0] if engines else None

    enc = model.encode_image(frame)
    tail = model.prompter.task_tail("query", QUESTION)
    pos = enc.length + len(tail)
    out["prefix_tokens"], out["decode_position"] = enc.length, pos

    # -- decode step: fast (graphs) vs the floor ---------------------------------------------
    nbytes = step_bytes(model, pos)
    out["step_bytes"] = nbytes
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    out["copy_bandwidth_GBs"] = bw / 1e9
    out["floor_ms_b1"] = nbytes / bw * 1e3

    def fast_step():
        for b in (1, 4):
            out[f"fast_graph_step_ms_b{b}"] = graph_step_ms(fe, b, pos, device, args.iters)
        out["kernels_per_step_b1"] = step_kernels(fe, 1, args.top, say)
        out["fast_vs_floor_b1"] = out["fast_graph_step_ms_b1"] / out["floor_ms_b1"]
        say(f"fast step b=1 {out['fast_graph_step_ms_b1']:.3f} ms, b=4 "
            f"{out['fast_graph_step_ms_b4']:.3f} ms; floor {out['floor_ms_b1']:.3f} ms "
            f"({nbytes / 1e9:.2f} GB at {bw / 1e9:.0f} GB/s)")
    if fe is not None:
        guarded(out, "fast_step", fast_step)

    # -- the reference engine's eager step at the same position ------------------------------
    cache = KVCache(model.config.text, pos + 1, device, dtype)
    cache.load_prefix(enc.cache, enc.length)
    tok = torch.tensor([5], device=device)

    def reference_step():
        with torch.inference_mode():
            model.forward_ids(torch.tensor(tail, device=device), enc.length, cache)
            out["reference_step_ms"] = median_ms(
                lambda: model_logits(model, model.forward_ids(tok, pos, cache)), device,
                max(3, args.iters // 2))
    guarded(out, "reference_step", reference_step)

    # -- transformers eager, same weights, same position -------------------------------------
    ids = torch.tensor([model.prefix_ids(enc.n_image_tokens) + tail], device=device)
    _, patches, positions, _ = model.image_inputs(frame)
    pv, pp = patches[None].to(device, dtype), positions[None].to(device)

    def hf_step():
        from transformers import DynamicCache
        with torch.inference_mode():
            hc = DynamicCache(config=hf.config.get_text_config())
            hf(input_ids=ids, pixel_values=pv, image_position_ids=pp, past_key_values=hc,
               use_cache=True)
            step_ids = torch.tensor([[5]], device=device)
            out["hf_eager_step_ms"] = median_ms(
                lambda: hf(input_ids=step_ids, past_key_values=hc, use_cache=True), device,
                max(3, args.iters // 2))
    if hf is not None:
        guarded(out, "hf_step", hf_step)

    # -- 640x480 encode + query(32) ------------------------------------------------------------
    reps = 3 if device.type == "cuda" else 1

    def fast_query():
        out["fast_encode_query_ms"] = wall_ms(
            lambda: greedy_query(fe, fe.encode_image(frame), args.tokens), device, reps)
        got, want = greedy_query(fe, enc, args.tokens), greedy_query(model, enc, args.tokens)
        a, w = got.output["answer"], want.output["answer"]
        out["answer_equal"] = a == w
        out["first_diff_char"] = next((i for i, (x, y) in enumerate(zip(a, w)) if x != y),
                                      None if a == w else min(len(a), len(w)))
        out["fast_timings"] = got.timings
        out["loop_wall_ms_b1"], out["gpu_idle_ms_b1"] = loop_ms(fe, enc)
        fe.close()
    if fe is not None:
        guarded(out, "fast_query", fast_query)
    guarded(out, "reference_query", lambda: out.__setitem__(
        "reference_encode_query_ms", wall_ms(
            lambda: greedy_query(model, model.encode_image(frame), args.tokens), device, reps)))
    if hf is not None:
        def hf_query():
            return hf_greedy(hf, ids, pv, pp, args.tokens)
        guarded(out, "hf_query", lambda: out.__setitem__("hf_encode_query_ms",
                                                         wall_ms(hf_query, device, reps)))

    def f(k, fmt="{:.3f}"):
        v = out.get(k)
        return "-" if v is None or v != v else fmt.format(v)
    rows = [
        ("decode step b=1, fast (CUDA graph)", f("fast_graph_step_ms_b1") + " ms",
         f"{f('fast_vs_floor_b1', '{:.2f}')}x floor {f('floor_ms_b1')} ms"),
        ("decode step b=4, fast (CUDA graph)", f("fast_graph_step_ms_b4") + " ms", ""),
        ("decode step b=1, reference (eager)", f("reference_step_ms") + " ms", ""),
        ("decode step b=1, transformers eager", f("hf_eager_step_ms") + " ms", "same weights"),
        ("kernels per fast step (b=1)", f("kernels_per_step_b1", "{}"), ""),
        ("pipelined loop b=1 (wall / GPU idle)", f("loop_wall_ms_b1") + " ms",
         f"idle {f('gpu_idle_ms_b1')} ms"),
        (f"640x480 encode + query({args.tokens}), fast", f("fast_encode_query_ms", "{:.1f}")
         + " ms", f"prefix {enc.length} tokens"),
        (f"640x480 encode + query({args.tokens}), reference",
         f("reference_encode_query_ms", "{:.1f}") + " ms", ""),
        (f"640x480 encode + query({args.tokens}), transformers",
         f("hf_encode_query_ms", "{:.1f}") + " ms", "generate, eager"),
        ("fast == reference greedy answer", str(out.get("answer_equal")),
         f"first differing char {out.get('first_diff_char')}"),
    ]
    say(f"\n## Gemma 4 {'tiny (smoke)' if args.smoke else 'E2B shapes'}, {out['device']}, "
        f"{dtype}, copy bandwidth {out['copy_bandwidth_GBs']:.0f} GB/s, position {pos}")
    say("| what | value | note |")
    say("|---|---|---|")
    for r in rows:
        say(f"| {r[0]} | {r[1]} | {r[2]} |")
    for k, v in out.items():
        if k.endswith("_error"):
            say(f"ERROR {k}: {v}")
    print(json.dumps(out, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gemma4_fast.json").write_text(
            json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
