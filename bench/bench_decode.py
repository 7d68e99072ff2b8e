"""GPU fast path benchmark (photon_core.fast) at real Moondream 2 shapes, random bf16 weights.

Measures, all in one run (so every ratio is against a same-run baseline):
  - copy bandwidth (device-to-device, bytes read + written) -> the decode bandwidth floor
    (bytes per step = text decoder weights incl. lm_head, excl. the input embedding, + the
    k/v read for the valid positions of every row) / bandwidth;
  - decode step ms at batch 1/2/4/8: pure graph replay (lm + forward pieces, back-to-back),
    and the full pipelined loop (wall per step, GPU time per step, GPU idle per step), vs the
    blocking loop;
  - Hugging Face transformers eager decoding (PhiForCausalLM, the same Phi-1.5 shape, greedy
    generate, per-step = (t(33 new) - t(1 new)) / 32) at batch 1 and 8;
  - 640x480 frame: encode + detect(5), encode + point(5), encode + query(32 tokens), forced
    lengths (ignore_eos), blocking vs pipelined, and the reference path (eager) alike;
  - a correctness check on the GPU: fast path (graphs, fp32 tiny model) vs the reference path
    for every skill at batch 1/2/4.

Usage: PYTHONPATH=. python3 bench/bench_decode.py [--iters 5] [--kv 832]
Writes $OUT/bench_decode.json and $OUT/bench_decode.md when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core.fast import FastEngine  # noqa: E402
from photon_core.moondream.config import MoondreamConfig  # noqa: E402
from photon_core.moondream.model import build_random_model  # noqa: E402
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config  # noqa: E402
from photon_core.task import Task  # noqa: E402

QUESTION = "What is in the image?"
LINES: list[str] = []


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


def cuda_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def copy_bandwidth():
    n = 2 * 2 ** 30 // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a), iters=20)
    bw = 2 * a.numel() * 2 / (ms * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def decoder_weight_bytes(model):
    w = model.weights
    return sum(t.numel() * t.element_size() for n, t in w.items()
               if n.startswith("text.") and n != "text.wte")


def kv_bytes(cfg, positions):
    t = cfg.text
    return sum(t.n_layers * 2 * t.n_kv_heads * (p + 1) * t.head_dim * 2 for p in positions)


def graph_step_ms(engine, b):
    r = engine.runner
    st = engine.state
    st.active.zero_()
    return cuda_ms(lambda: (r.run("lm", b), r.run("forward", b)), iters=50)


def loop_step(engine, enc, b, pipelined, steps=40, warm=4):
    engine.pipelined = pipelined
    runs = [engine.start(enc, Task("query", question=QUESTION, max_tokens=steps + warm + 8),
                         ignore_eos=True) for _ in range(b)]
    for _ in range(warm):
        engine.step_batch(runs)
    torch.cuda.synchronize()
    engine.reset_metrics()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step_batch(runs)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    m = engine.metrics()
    positions = [r.pos for r in runs]
    for r in runs:
        r.cancel("cancelled")
    engine.drain()
    return {"wall_ms_per_step": wall,
            "gpu_step_ms": m["gpu_step"].get("median_ms"),
            "gpu_idle_ms_mean": m["gpu_idle_per_step"].get("mean_ms"),
            "gpu_idle_ms_median": m["gpu_idle_per_step"].get("median_ms"),
            "gpu_idle_ms_p90": m["gpu_idle_per_step"].get("p90_ms"),
            "host_launch_ms": m["host_launch_ms_mean"], "host_commit_ms": m["host_commit_ms_mean"],
            "positions": positions}


def hf_decode(b, prompt_len=740, new=32):
    from transformers import PhiConfig, PhiForCausalLM
    cfg = PhiConfig(vocab_size=51200, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                    partial_rotary_factor=0.5, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = PhiForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(10, 51200, (b, prompt_len), device="cuda")
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, eos_token_id=None)

    def t(n, reps=3):
        gen(n)
        xs = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(n)
            torch.cuda.synchronize()
            xs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(xs)

    per = (t(new + 1) - t(1)) / new
    del hf
    torch.cuda.empty_cache()
    return per


def e2e(engine_or_model, frame, task, iters, fast=True):
    def once():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc = engine_or_model.encode_image(frame)
        t1 = time.perf_counter()
        if fast:
            res = engine_or_model.run(enc, task, ignore_eos=True)
        else:
            r = engine_or_model.start(enc, task, ignore_eos=True)
            while r.step():
                pass
            res = r.result()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        return (t2 - t0) * 1e3, (t1 - t0) * 1e3, res.tokens
    once()
    xs = [once() for _ in range(iters)]
    tot = statistics.median(x[0] for x in xs)
    enc = statistics.median(x[1] for x in xs)
    return {"ms": tot, "encode_ms": enc, "decode_part_ms": tot - enc, "steps": xs[0][2]}


def attention_variants(model, kv):
    res = {}
    for variant in ("sdpa", "matmul"):
        eng = FastEngine(model, max_batch=1, kv_capacity=kv, attention=variant, megakernel="off")
        res[variant] = graph_step_ms(eng, 1)
        eng.close()
        del eng
        torch.cuda.empty_cache()
    return res


def profile_step(engine):
    from torch.profiler import ProfilerActivity, profile
    from photon_core.fast import decode_step as ds
    st = engine.state
    st.active.zero_()
    with torch.inference_mode():
        for _ in range(3):
            ds.lm_greedy(st, 1)
            ds.forward(st, 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ds.lm_greedy(st, 1)
            ds.forward(st, 1)
            torch.cuda.synchronize()
    agg = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            agg[ev.name] = agg.get(ev.name, 0.0) + ev.device_time_total
    top = sorted(agg.items(), key=lambda kv: -kv[1])[:14]
    total = sum(agg.values())
    return [("TOTAL kernel time", total), ("kernel launches", float(sum(
        1 for ev in prof.events() if ev.device_type.name == "CUDA")))] + top


def encode_breakdown(model, frame):
    from photon_core.moondream import text, vision
    from photon_core.moondream.crops import overlap_crops
    from photon_core.moondream.image_input import to_rgb_array
    from photon_core.moondream.kv_cache import KVCache
    v, w, t = model.config.vision, model.weights, model.config.text
    xs = {"crops_cpu": [], "vision_encoder": [], "projection": [], "prefix_prefill": []}
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        arr = to_rgb_array(frame, model.max_image_side)
        crops, tiling = overlap_crops(arr, v.crop_size, v.enc_patch_size, v.overlap_margin,
                                      v.max_crops)
        t1 = time.perf_counter()
        with torch.inference_mode():
            feats = vision.encoder(w, v, vision.normalize(crops, w.device, w.dtype))
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            toks = vision.project(w, v, feats, tiling)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            bos = text.embed(w, torch.tensor([model.config.tokenizer.bos_id], device=w.device))
            prefix = torch.cat([bos, toks], dim=0)[None]
            cache = KVCache(t.n_layers, t.n_kv_heads, prefix.shape[1], t.head_dim, w.device,
                            w.dtype)
            text.decoder(w, t, prefix, 0, cache, model.prefix_len)
            torch.cuda.synchronize()
            t4 = time.perf_counter()
        for k, a, b in (("crops_cpu", t0, t1), ("vision_encoder", t1, t2),
                        ("projection", t2, t3), ("prefix_prefill", t3, t4)):
            xs[k].append((b - a) * 1e3)
    return {k: round(statistics.median(x[1:]), 2) for k, x in xs.items()}


def prompt_prefill_ms(engine, model):
    """The graphed prompt prefill (graphed_prefill.py) at T = 8 / 16 / 32 tokens after the
    730-token image prefix: the engine's (fused kernels up to FUSED_MAX_T) vs a torch-only
    GraphedPrefill over the same state, both as CUDA graphs, same run."""
    from photon_core.fast.graphed_prefill import GraphedPrefill
    torch_pf = GraphedPrefill(engine.state, True)
    torch_pf.fused = None
    torch_pf.capture_stream = engine.capture_stream
    torch_pf.capture()
    res = {}
    start = model.prefix_len
    for T in (8, 16, 32):
        prompt = list(range(100, 100 + T))
        row = {}
        for name, pf in (("engine", engine.prefill), ("torch", torch_pf)):
            row[name] = round(cuda_ms(lambda pf=pf: pf.run(0, start, prompt), iters=20), 3)
        row["torch/engine"] = round(row["torch"] / row["engine"], 2)
        res[T] = row
    del torch_pf
    return res


def deterministic_check(engine, model, enc, kv):
    """FastEngine(deterministic=True) vs the default engine: graph replay ms at batch 1 and 8,
    and whether two identical query runs (prefill + 24 steps) leave the same bits (final
    hidden state and the row's k/v) in each engine."""
    det = FastEngine(model, max_batch=8, kv_capacity=kv, deterministic=True, megakernel="off")
    res = {}
    for name, e in (("default", engine), ("deterministic", det)):
        e.pipelined = True
        states = []
        for _ in range(3):
            r = e.start(enc, Task("query", question=QUESTION, max_tokens=64), ignore_eos=True)
            for _ in range(24):
                e.step_batch([r])
            torch.cuda.synchronize()
            states.append((e.state.hidden[r.row].clone(),
                           e.kv.data[:, :, r.row, :, :r.pos].clone()))
            r.cancel()
            e.drain()
        same = all(torch.equal(h, states[0][0]) and torch.equal(k, states[0][1])
                   for h, k in states[1:])
        res[name] = {"graph_ms_b1": round(graph_step_ms(e, 1), 4),
                     "graph_ms_b8": round(graph_step_ms(e, 8), 4),
                     "three_runs_bitwise_equal": same}
    res["det/default_b1"] = round(res["deterministic"]["graph_ms_b1"] /
                                  res["default"]["graph_ms_b1"], 3)
    det.close()
    return res


def gpu_correctness():
    cfg = tiny_config(fast=True)
    m = build_random_model(cfg, device="cuda", dtype="fp32", seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, max_batch=4)
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((120, 160), (200, 90))]
    tasks = [Task("detect", object="person", max_objects=8), Task("point", object="cup", max_objects=8),
             Task("query", question="What is it?", max_tokens=24),
             Task("caption", caption_length="short", max_tokens=24)]
    total = same = 0
    bad = []
    for fi, fr in enumerate(frames):
        enc = m.encode_image(fr)
        for bs in (1, 2, 4):
            for k in range(len(tasks)):
                group = [tasks[(k + j) % len(tasks)] for j in range(bs)]
                got = fe.run_batch([(enc, t) for t in group])
                for t, g in zip(group, got):
                    ref = m.run(enc, t)
                    total += 1
                    ok = (ref.output == g.output and ref.tokens == g.tokens
                          and ref.finish_reason == g.finish_reason)
                    same += ok
                    if not ok:
                        bad.append({"frame": fi, "batch": bs, "skill": t.skill})
    fe.close()
    return {"compared": total, "identical": same, "mismatches": bad[:10]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kv", type=int, default=832)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "date": time.strftime("%Y-%m-%d"), "kv_capacity": args.kv}
    say(f"# bench_decode  {out['gpu']}  torch {out['torch']}  kv capacity {args.kv}")

    bw = copy_bandwidth()
    out["copy_bw_TBps"] = bw / 1e12
    say(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")

    try:
        out["gpu_correctness"] = gpu_correctness()
    except Exception as e:  # noqa: BLE001
        out["gpu_correctness"] = {"error": repr(e), "tb": traceback.format_exc()}
    say(f"GPU correctness (fp32 tiny, graphs vs reference): {out['gpu_correctness']}")

    model = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    t0 = time.perf_counter()
    # the fused graph's figures (their history in docs/benchmarks.md); the megakernel that
    # serves bucket 1 on Hopper by default has its own bench (bench_megakernel.py)
    engine = FastEngine(model, max_batch=8, kv_capacity=args.kv, megakernel="off")
    try:     # before any row is in use: capturing the torch prefill writes k/v of row 0
        out["prompt_prefill_ms"] = prompt_prefill_ms(engine, model)
        say(f"prompt prefill (graph replay, ms): {out['prompt_prefill_ms']}")
    except Exception as e:  # noqa: BLE001
        say(f"prompt prefill timing failed: {e!r}")
    out["warmup_capture_ms"] = (time.perf_counter() - t0) * 1e3
    out["graphs"] = len(engine.runner.graphs)
    out["fused_step"] = engine.state.fused is not None
    say(f"FastEngine build + capture of {out['graphs']} graphs: {out['warmup_capture_ms']:.0f} ms"
        f"; fused Triton step (EngineOptions.fused={engine.options.fused}): "
        f"{out['fused_step']}")
    wbytes = decoder_weight_bytes(model)
    out["decoder_weight_GB"] = wbytes / 1e9
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    enc = engine.encode_image(frame)
    ref_enc = model.encode_image(frame)
    out["encode_graphed_equals_reference"] = bool(torch.equal(enc.kv, ref_enc.kv))
    del ref_enc

    def enc_ms(fn):
        xs = []
        for _ in range(args.iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(frame)
            torch.cuda.synchronize()
            xs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(xs[1:])
    out["encode_ms"] = {"reference": enc_ms(model.encode_image),
                        "graphed": enc_ms(engine.encode_image)}
    say(f"encode_image 640x480: reference {out['encode_ms']['reference']:.1f} ms, graphed "
        f"{out['encode_ms']['graphed']:.1f} ms, k/v bitwise equal: "
        f"{out['encode_graphed_equals_reference']}")

    try:
        out["attention_variants_b1"] = attention_variants(model, args.kv)
        say(f"graph replay b=1 by attention variant (ms): {out['attention_variants_b1']}")
    except Exception as e:  # noqa: BLE001
        say(f"attention variants failed: {e!r}")
    try:
        out["profile_b1"] = profile_step(engine)
        say("top kernels of one eager forward+lm step at b=1 (CUDA us):")
        for k, v in out["profile_b1"]:
            say(f"  {v:9.1f}  {k[:110]}")
    except Exception as e:  # noqa: BLE001
        say(f"profile failed: {e!r}")
    try:
        out["encode_breakdown"] = encode_breakdown(model, frame)
        say(f"encode breakdown ms: {out['encode_breakdown']}")
    except Exception as e:  # noqa: BLE001
        say(f"encode breakdown failed: {e!r}")

    say("\n## Decode step (bf16, query rows)\n")
    say("| batch | floor ms | graph replay ms | x floor | pipelined wall ms/step | GPU ms/step "
        "| GPU idle ms/step (mean / p90) | blocking wall ms/step | blocking GPU idle ms | "
        "HF eager ms/step | HF / fast |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    dec = {}
    hf = {}
    if not args.skip_hf:
        for b in (1, 8):
            try:
                hf[b] = hf_decode(b)
            except Exception as e:  # noqa: BLE001
                hf[b] = None
                out.setdefault("hf_errors", {})[b] = repr(e)
    for b in (1, 2, 4, 8):
        g = graph_step_ms(engine, b)
        p = loop_step(engine, enc, b, pipelined=True)
        k = loop_step(engine, enc, b, pipelined=False)
        pos = [int(x) for x in p["positions"]]
        floor = (wbytes + kv_bytes(model.config, pos)) / bw * 1e3
        row = {"floor_ms": floor, "graph_ms": g, "x_floor": g / floor, "pipelined": p,
               "blocking": k, "hf_ms": hf.get(b)}
        dec[b] = row
        hfs = f"{hf[b]:.2f} | {hf[b] / p['wall_ms_per_step']:.1f}x" if hf.get(b) else "- | -"
        say(f"| {b} | {floor:.3f} | {g:.3f} | {g / floor:.2f} | {p['wall_ms_per_step']:.3f} | "
            f"{p['gpu_step_ms']:.3f} | {p['gpu_idle_ms_mean']:.4f} / {p['gpu_idle_ms_p90']:.4f} | "
            f"{k['wall_ms_per_step']:.3f} | {k['gpu_idle_ms_mean']:.4f} | {hfs} |")
    out["decode"] = dec
    out["hf_eager_ms"] = hf

    say("\n## 640x480 frame, encode + skill (forced lengths), median of "
        f"{args.iters}\n")
    say("| task | steps | reference eager ms | blocking ms | pipelined ms | pipelined / blocking "
        "| encode ms | prefill+decode ms blocking / pipelined | task alone on a fixed encoding, "
        "ms blocking / pipelined (ratio) | GPU idle ms/step pipelined |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    tasks = {"encode + detect(5)": Task("detect", object="person", max_objects=5),
             "encode + point(5)": Task("point", object="person", max_objects=5),
             "encode + query(32 tokens)": Task("query", question=QUESTION, max_tokens=32)}
    e2e_rows = {}
    for name, task in tasks.items():
        ref = e2e(model, frame, task, max(2, args.iters // 2), fast=False)
        blk_runs, pip_runs, idles = [], [], {}
        for i in range(args.iters):          # interleaved: drift hits both modes alike
            for mode in (False, True):
                engine.pipelined = mode
                engine.reset_metrics()
                (pip_runs if mode else blk_runs).append(e2e(engine, frame, task, 1))
                idles.setdefault(mode, []).append(
                    engine.metrics()["gpu_idle_per_step"].get("mean_ms") or float("nan"))
        enc_fixed = engine.encode_image(frame)
        t_only = {False: [], True: []}
        for i in range(3 * args.iters):      # the task alone on a fixed encoding
            for mode in (False, True):
                engine.pipelined = mode
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.run(enc_fixed, task, ignore_eos=True)
                torch.cuda.synchronize()
                t_only[mode].append((time.perf_counter() - t0) * 1e3)
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        blk = {k: med(blk_runs, k) for k in ("ms", "encode_ms", "decode_part_ms")}
        pip = {k: med(pip_runs, k) for k in ("ms", "encode_ms", "decode_part_ms")}
        pip["steps"] = pip_runs[0]["steps"]
        idle = statistics.median(idles[True])
        tb, tp = statistics.median(t_only[False]), statistics.median(t_only[True])
        e2e_rows[name] = {"reference": ref, "blocking": blk, "pipelined": pip,
                          "task_only_blocking_ms": tb, "task_only_pipelined_ms": tp,
                          "gpu_idle_mean_ms_pipelined": idle,
                          "gpu_idle_mean_ms_blocking": statistics.median(idles[False])}
        say(f"| {name} | {pip['steps']} | {ref['ms']:.1f} | {blk['ms']:.1f} | {pip['ms']:.1f} | "
            f"{pip['ms'] / blk['ms']:.3f} | {pip['encode_ms']:.1f} | "
            f"{blk['decode_part_ms']:.1f} / {pip['decode_part_ms']:.1f} | "
            f"{tb:.2f} / {tp:.2f} ({tp / tb:.3f}) | {idle:.4f} |")
    out["e2e"] = e2e_rows
    out["metrics"] = engine.metrics()
    try:
        out["deterministic"] = deterministic_check(engine, model, enc, args.kv)
        say(f"\ndeterministic engine vs default (same run): {out['deterministic']}")
    except Exception as e:  # noqa: BLE001
        say(f"deterministic check failed: {e!r}")
    engine.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_decode.json").write_text(json.dumps(out, indent=1,
                                                                           default=str))
        Path(os.environ["OUT"], "bench_decode.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
