"""Where the 640x480 encode goes, on the GPU, real Moondream 2 shapes, random bf16 weights.

All in one run (ratios against same-run baselines):
  - overlap crops: PIL on the CPU vs the torch Lanczos on the GPU (bitwise compared);
  - vision encoder (9 crops), projection, image-prefix prefill (730 tokens): eager and as
    CUDA graphs, each timed alone with CUDA events;
  - the graphed encoder's replay alone, and encode_image end to end: reference path, fast
    path with CPU crops, fast path with GPU crops;
  - the top kernels of one eager vision encoder and one eager prefix prefill (profiler);
  - SDPA backends at the vision attention shape [9, 16, 729, 72] and the vision GEMMs'
    TFLOP/s (what a faster encoder could use);
  - encode_ab: the previous encode path against the new one in the same run (issue 13):
    FastEngine(encoder="reference") = the reference's functions as one graph per tiling
    (graphed_reference_encoder.py, as before) vs FastEngine(encoder="fast") = vision_fused.py (GELU
    epilogue), the mask-free prefix attention, graphed_batch_encoder.py; per engine: 640x480
    encode_image, global-only encode, encode_batch of n frames vs n encode_image calls,
    encode + detect(5), the graph replay alone, k/v difference to the reference encode;
    and the parts alone as graphs (vision old/new, prefix prefill old/new at 1 and 4 frames).

Usage: PYTHONPATH=. python3 bench/bench_encode.py [--iters 10] [--ab-only]
Writes $OUT/bench_encode.json and $OUT/bench_encode.md when OUT is set.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import LINES, cuda_ms, say  # noqa: E402
from bench.bench_kernels import graph_ms  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.moondream import text, vision  # noqa: E402
from photon_core.moondream.config import MoondreamConfig  # noqa: E402
from photon_core.moondream.kv_cache import KVCache  # noqa: E402
from photon_core.moondream.model import build_random_model  # noqa: E402


def wall_ms(fn, iters=10, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def top_kernels(fn, n=8):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in evs)
    launches = sum(e.count for e in evs)
    evs.sort(key=lambda e: -e.self_device_time_total)
    return {"total_us": round(total, 1), "launches": launches,
            "top": [(e.key[:70], round(e.self_device_time_total, 1), e.count)
                    for e in evs[:n]]}


def section(out, name, fn):
    """out[name] = fn(), or its error and traceback; printed either way (the run goes on)."""
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001
        out[name] = {"error": repr(e), "tb": traceback.format_exc()[-1500:]}
    say(f"{name}: {json.dumps(out[name], default=str)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ab-only", action="store_true",
                    help="only the old-vs-new section (encode_ab)")
    ap.add_argument("--batch-sizes", default="2,4", help="encode_batch sizes for encode_ab")
    args = ap.parse_args()
    it = args.iters
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "date": time.strftime("%Y-%m-%d")}
    say(f"# bench_encode  {out['gpu']}  torch {out['torch']}")
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    v, w, t = m.config.vision, m.weights, m.config.text
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    if args.ab_only:
        encode_ab(out, m, frame, it, [int(b) for b in args.batch_sizes.split(",") if b])
        write_out(out)
        return

    def crops():
        from photon_core.moondream import crops as C
        from photon_core.moondream.image_input import to_rgb_array
        arr = to_rgb_array(frame, m.max_image_side)
        args_ = (v.crop_size, v.enc_patch_size, v.overlap_margin, v.max_crops)
        res = {"cpu_pil_ms": wall_ms(lambda: C.overlap_crops(arr, *args_), it)}
        if hasattr(C, "overlap_crops_tensor"):
            dev_fn = lambda: C.overlap_crops_tensor(  # noqa: E731
                torch.from_numpy(arr).to("cuda", non_blocking=False), *args_)
            res["gpu_torch_ms"] = wall_ms(dev_fn, it)
            a, _ = C.overlap_crops(arr, *args_)
            b, _ = dev_fn()
            res["identical"] = bool(np.array_equal(a, b.cpu().numpy()))
            res["cpu_over_gpu"] = round(res["cpu_pil_ms"] / res["gpu_torch_ms"], 2)
        return res
    section(out, "crops", crops)

    with torch.inference_mode():
        arr, x, tiling = m.image_crops(frame)
        feats = vision.encoder(w, v, x)
        toks = vision.project(w, v, feats, tiling)
        bos = text.embed(w, torch.tensor([m.config.tokenizer.bos_id], device="cuda"))
        prefix = torch.cat([bos, toks], dim=0)[None]
        cache = KVCache(t.n_layers, t.n_kv_heads, prefix.shape[1], t.head_dim, w.device,
                        w.dtype)

        def run_prefill():
            cache.length = 0
            text.decoder(w, t, prefix, 0, cache, m.prefix_len)

        def parts():
            res = {}
            res["vision_eager_ms"] = cuda_ms(lambda: vision.encoder(w, v, x), it)
            res["vision_graph_ms"] = graph_ms(lambda: vision.encoder(w, v, x), it)
            res["projection_eager_ms"] = cuda_ms(lambda: vision.project(w, v, feats, tiling), it)
            res["prefix_prefill_eager_ms"] = cuda_ms(run_prefill, it)
            res["prefix_prefill_graph_ms"] = graph_ms(run_prefill, it)
            n_tok = x.shape[0] * feats.shape[1]
            vis_params = sum(p.numel() for n, p in w.items() if n.startswith("vision.blocks"))
            res["vision_gemm_tflop"] = round(2 * n_tok * vis_params / 1e12, 2)
            dec_params = sum(p.numel() for n, p in w.items() if n.startswith("text.blocks"))
            res["prefill_gemm_tflop"] = round(2 * prefix.shape[1] * dec_params / 1e12, 2)
            return res
        section(out, "parts", parts)
        section(out, "profile_vision_eager", lambda: top_kernels(lambda: vision.encoder(w, v, x)))
        section(out, "profile_prefill_eager", lambda: top_kernels(run_prefill))

        def sdpa():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            q, k, vv = (torch.randn(9, 16, 729, 72, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3))
            res = {}
            for be in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
                try:
                    with sdpa_kernel(getattr(SDPBackend, be)):
                        res[be] = round(cuda_ms(lambda: F.scaled_dot_product_attention(
                            q, k, vv), it) * 27, 2)     # x 27 layers
                except Exception as e:  # noqa: BLE001
                    res[be] = repr(e)[:80]
            res["default"] = round(cuda_ms(lambda: F.scaled_dot_product_attention(q, k, vv),
                                           it) * 27, 2)
            res["note"] = "ms for 27 layers"
            return res
        section(out, "sdpa_vision_shape", sdpa)

        def gemms():
            res = {}
            a = torch.randn(x.shape[0] * 729, 1152, device="cuda", dtype=torch.bfloat16)
            for name in ("qkv", "proj", "fc1", "fc2"):
                key = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1",
                       "fc2": "mlp.fc2"}[name]
                wt = w[f"vision.blocks.0.{key}.weight"]
                inp = a if wt.shape[1] == 1152 else torch.randn(a.shape[0], wt.shape[1],
                                                               device="cuda",
                                                               dtype=torch.bfloat16)
                ms = cuda_ms(lambda: F.linear(inp, wt, w[f"vision.blocks.0.{key}.bias"]), it)
                res[name] = {"ms": round(ms, 4),
                             "tflops": round(2 * inp.shape[0] * wt.numel() / ms / 1e9, 1)}
            return res
        section(out, "vision_gemms", gemms)

    def e2e():
        fe = FastEngine(m, max_batch=4)
        enc = fe.encode_image(frame)
        entry = next(iter(fe.encoder.entries.values()))
        res = {"graphed_encoder_replay_ms": cuda_ms(entry.graph.replay, it)}
        res["encode_reference_ms"] = wall_ms(lambda: m.encode_image(frame), it)
        saved = m.crops_on_device
        try:
            for label, val in (("cpu", False), ("gpu", True)):
                m.crops_on_device = val
                res[f"encode_fast_{label}_crops_ms"] = wall_ms(lambda: fe.encode_image(frame),
                                                               it)
                res[f"kv_equal_{label}"] = bool(torch.equal(fe.encode_image(frame).kv,
                                                            enc.kv))
        finally:
            m.crops_on_device = saved
        res["encode_fast_default_ms"] = wall_ms(lambda: fe.encode_image(frame), it)
        fe.close()
        return res
    section(out, "encode_image", e2e)
    encode_ab(out, m, frame, it, [int(b) for b in args.batch_sizes.split(",") if b])
    write_out(out)


def write_out(out):
    od = os.environ.get("OUT")
    if od:
        Path(od).mkdir(parents=True, exist_ok=True)
        (Path(od) / "bench_encode.json").write_text(json.dumps(out, indent=1, default=str))
        (Path(od) / "bench_encode.md").write_text("\n".join(LINES) + "\n")


def _rel(a, b):
    a, b = a.float(), b.float()
    return round((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30), 6)


def encode_ab(out, m, frame, it, batch_sizes):
    """Previous encode path vs the new one, same run, same model (see the module doc)."""
    from photon_core.models.moondream2 import batched_encode, vision_fused
    from photon_core.models.moondream2.prefix_prefill import prefill_prefix
    from photon_core.ops.linear_gelu import linear_gelu
    from photon_core.task import Task

    v, w, t = m.config.vision, m.weights, m.config.text
    rng = np.random.default_rng(1)
    frames = [frame] + [rng.integers(0, 256, frame.shape, dtype=np.uint8)
                        for _ in range(max(batch_sizes + [1]) - 1)]
    detect = Task("detect", object="person", max_objects=5)

    def parts():
        res = {}
        with torch.inference_mode():
            _, x, tiling = m.image_crops(frame)
            res["vision_old_graph_ms"] = graph_ms(lambda: vision.encoder(w, v, x), it)
            res["vision_new_graph_ms"] = graph_ms(lambda: vision_fused.encoder(w, v, x), it)
            res["vision_new_rel_diff"] = _rel(vision_fused.encoder(w, v, x),
                                              vision.encoder(w, v, x))
            res["vision_new_unfused_norms_graph_ms"] = graph_ms(
                lambda: vision_fused.encoder(w, v, x, fuse_norms=False), it)
            for n in sorted({1, *batch_sizes}):
                pre = torch.randn(n, m.prefix_len, t.dim, device="cuda", dtype=w.dtype)
                kv = batched_encode.kv_buffer(m, n)
                for label, fast in (("old", False), ("new", True)):
                    res[f"prefill_{label}_n{n}_graph_ms"] = graph_ms(
                        lambda: prefill_prefix(w, t, pre, kv, m.prefix_len, fast=fast), it)
            a = torch.randn(4096, 1152, device="cuda")
            wt, b = torch.randn(4304, 1152, device="cuda") / 34, torch.randn(4304, device="cuda")
            y = linear_gelu(a, wt, b)
            lin = F.linear(a, wt, b)
            res["linear_gelu_fp32_diff_to_tanh"] = _rel(y, F.gelu(lin, approximate="tanh"))
            res["linear_gelu_fp32_diff_to_erf"] = _rel(y, F.gelu(lin))
        return res
    section(out, "encode_ab_parts", parts)

    with torch.inference_mode():
        ref_kv = [m.encode_image(f).kv for f in frames]
    engines = {}

    def one(label, encoder):
        fe = FastEngine(m, max_batch=8, encoder=encoder)
        engines[label] = fe
        res = {}
        e0 = fe.encode_image(frame)                      # captures
        res["kv_rel_diff_vs_reference"] = _rel(e0.kv, ref_kv[0])
        res["kv_equal_reference"] = bool(torch.equal(e0.kv, ref_kv[0]))
        res["encode_ms"] = wall_ms(lambda: fe.encode_image(frame), it)
        fe.encode_image(frame, crops="global")
        res["encode_global_ms"] = wall_ms(lambda: fe.encode_image(frame, crops="global"), it)
        for f in frames:
            fe.encode_image(f)
        res["graphs_prepared"] = fe.prepare_encode(shapes=(frame.shape[:2],),
                                                   batch_sizes=(1, *batch_sizes))
        for n in batch_sizes:
            fr = frames[:n]
            encs = fe.encode_batch(fr)
            res[f"batch{n}_kv_rel_diff_vs_reference"] = max(
                _rel(e.kv, r) for e, r in zip(encs, ref_kv))
            one_by_one = wall_ms(lambda: [fe.encode_image(f) for f in fr], it)
            batched = wall_ms(lambda: fe.encode_batch(fr), it)
            res[f"batch{n}_one_by_one_ms_per_frame"] = round(one_by_one / n, 3)
            res[f"batch{n}_batched_ms_per_frame"] = round(batched / n, 3)
            res[f"batch{n}_batched_over_one_by_one"] = round(batched / one_by_one, 3)
        res["encode_detect5_ms"] = wall_ms(
            lambda: fe.run(fe.encode_image(frame), detect, ignore_eos=True), it)
        res["encode_global_detect5_ms"] = wall_ms(
            lambda: fe.run(fe.encode_image(frame, crops="global"), detect, ignore_eos=True), it)
        try:
            if label == "old":
                entry = next(iter(fe.encoder.entries.values()))
            else:
                entry = next(e for k, e in fe.batch_encoder.entries.items()
                             if len(k) == 1 and k[0].crops == "overlap")
            res["graph_replay_ms"] = cuda_ms(entry.graph.replay, it)
        except Exception as e:  # noqa: BLE001
            res["graph_replay_ms"] = repr(e)[:120]
        res["encoder_summary"] = fe.batch_encoder.summary()
        return res
    section(out, "encode_ab_old", lambda: one("old", "reference"))
    section(out, "encode_ab_new", lambda: one("new", "fast"))

    def agreement():
        old, new = engines["old"], engines["new"]
        a = old.run(old.encode_image(frame), detect)
        b = new.run(new.encode_image(frame), detect)
        return {"detect5_same_output": a.output == b.output,
                "note": "random weights: near-ties decide, a plumbing check only"}
    section(out, "encode_ab_agreement", agreement)
    for fe in engines.values():
        fe.close()

    o, nw, p = out.get("encode_ab_old", {}), out.get("encode_ab_new", {}), \
        out.get("encode_ab_parts", {})
    say("")
    say("| 640x480, bf16, real shapes | old (encoder=reference) | new (encoder=fast) | new / old |")
    say("|---|---|---|---|")

    def row(name, a, b):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
            say(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
        else:
            say(f"| {name} | {a} | {b} | - |")
    row("encode_image ms", o.get("encode_ms"), nw.get("encode_ms"))
    row("encode global-only ms", o.get("encode_global_ms"), nw.get("encode_global_ms"))
    for n in batch_sizes:
        row(f"encode_batch({n}) ms/frame (batched)",
            o.get(f"batch{n}_batched_ms_per_frame"), nw.get(f"batch{n}_batched_ms_per_frame"))
        row(f"  n x encode_image ms/frame", o.get(f"batch{n}_one_by_one_ms_per_frame"),
            nw.get(f"batch{n}_one_by_one_ms_per_frame"))
    row("encode + detect(5) ms", o.get("encode_detect5_ms"), nw.get("encode_detect5_ms"))
    row("encode global-only + detect(5) ms", o.get("encode_global_detect5_ms"),
        nw.get("encode_global_detect5_ms"))
    row("encode graph replay ms", o.get("graph_replay_ms"), nw.get("graph_replay_ms"))
    row("vision graph ms (9 crops)", p.get("vision_old_graph_ms"), p.get("vision_new_graph_ms"))
    row("  new without the add+LayerNorm kernel", p.get("vision_old_graph_ms"),
        p.get("vision_new_unfused_norms_graph_ms"))
    for n in sorted({1, *batch_sizes}):
        row(f"prefix prefill graph ms, {n} frame(s)", p.get(f"prefill_old_n{n}_graph_ms"),
            p.get(f"prefill_new_n{n}_graph_ms"))
    row("k/v max rel diff vs reference encode", o.get("kv_rel_diff_vs_reference"),
        nw.get("kv_rel_diff_vs_reference"))

    def verdict(v, target):
        return "n/a" if not isinstance(v, (int, float)) else \
            f"{v:.1f} ms ({'met' if v <= target else 'missed'})"
    say(f"issue 13 targets (new): 640x480 encode <= 14 ms: {verdict(nw.get('encode_ms'), 14)}; "
        f"global-only {verdict(nw.get('encode_global_ms'), 14)}; encode + detect(5) <= 30 ms: "
        f"{verdict(nw.get('encode_detect5_ms'), 30)}, global-only "
        f"{verdict(nw.get('encode_global_detect5_ms'), 30)}")


if __name__ == "__main__":
    main()
