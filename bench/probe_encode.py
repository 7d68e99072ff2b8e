"""Where the fast encode's time goes now, and what the parts could reach (issue 13), on the GPU.

Real Moondream 2 shapes, random bf16 weights, one process, every figure against a baseline of
the same run:
  - kernel time by kind (GEMM / attention / norm / elementwise / other) of the runtime's
    vision encoder (vision_fused.encoder, 9 crops) and image-prefix prefill
    (prefill_prefix fast=True, 730 tokens, 1 and 4 frames), from the profiler;
  - vision attention at [9, 16, 729, 72]: SDPA per backend with the head size as it is and
    zero-padded to 80 / 96 / 128 (same result: padded q/k add 0 to every score, padded v
    columns are sliced off; the scale stays 1/sqrt(72));
  - bf16 GEMM rates (TFLOP/s) of the vision shapes (M = 6561) and the prefill shapes
    (M = 730 and 2920), F.linear with bias;
  - torch.compile of vision_fused.encoder's math (--compile-mode, default "default"): compile
    seconds and the graph-replayed time, against the same encoder as a CUDA graph (what a
    compiler would buy); the vision GEMMs alone compiled the same way against cuBLAS
    and the image-prefix prefill's (730 rows) (gemm_rates_compiled: with
    max-autotune-no-cudagraphs, Inductor's Triton GEMM templates).

Usage: PYTHONPATH=. python3 bench/probe_encode.py [--iters 10] [--no-compile]
           [--compile-mode max-autotune-no-cudagraphs] [--only SECTION,...]
Writes $OUT/probe_encode.json when OUT is set.

A/B of the encode between checkouts (issue 13), same GPU, same run:
    PYTHONPATH=. python3 bench/probe_encode.py --ab .before . [--rounds 1] [--iters 10]
each TREE a checkout's root (`.before` = `git archive <old commit>` unpacked beside the
working tree); every tree runs in its own subprocess with its own photon_core (alternating,
--rounds times) and measures, at real shapes with random bf16 weights (seed 0):
vision_fused.encoder as a graph (9 crops), prefill_prefix(fast=True) as a graph at 1 and 4
frames (+ kernel kinds / launches), FastEngine() defaults: encode_image 640x480 end to end
(overlap crops and crops="global"), encode_batch of 4 x 640x480 (prepared), encode +
detect(5), the pieces of encode_image (crops on the GPU, the frame or crops copy-in, the
graph replay, the k/v copy-out), the k/v max relative difference to the reference encode
(model.encode_image, the reference's functions) and a sha256 of the k/v bits (the table says
whether every tree's are the same). A tree whose graphed encoder has crops_in_graph (the crops
inside the encode graph) also runs, in the same process, encode_image with the crops made
outside the graph (its k/v compared bitwise, its time and graph replay). Prints a table old /
new and writes $OUT/probe_encode_ab.json. --encode-only skips the vision / prefill kernel
sections (two trees in a few minutes):
    PYTHONPATH=. python3 bench/probe_encode.py --ab .before . --iters 5 --encode-only \
        --child-timeout 150
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--child" in sys.argv:       # an A/B child: the tree's photon_core (and bench helpers) first
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--child") + 1]).resolve()))

from bench.bench_decode import LINES, cuda_ms, say  # noqa: E402
from bench.bench_kernels import graph_ms  # noqa: E402
from bench.bench_encode import _rel, section, wall_ms  # noqa: E402
from photon_core.models.moondream2 import batched_encode, vision_fused  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402

KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "_mm_")),
         ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
         ("norm", ("layer_norm", "layernorm", "_add_ln", "norm")),
         ("elementwise", ("elementwise", "vectorized", "gelu", "copy", "cat", "index",
                          "rope", "rotary")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_times(fn, reps=1) -> list[tuple[str, float, int]]:
    """fn()'s GPU kernels by name: [(name, ms per call, launches per call)], longest first
    (torch profiler, the mean of `reps` profiled calls after one unprofiled)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    evs.sort(key=lambda e: -e.self_device_time_total)
    return [(e.key, e.self_device_time_total / 1e3 / reps, e.count // reps) for e in evs]


def profile_kinds(fn, top=6, reps=1, key_chars=80):
    """GPU kernel time of one fn() call (the mean of `reps` profiled calls, after one
    unprofiled): total, by kind (KINDS), launches, the `top` kernels (name, ms, calls)."""
    rows = kernel_times(fn, reps)
    by_kind: dict[str, float] = {}
    for name, ms, _ in rows:
        k = kind_of(name)
        by_kind[k] = by_kind.get(k, 0.0) + ms
    return {"total_ms": round(sum(by_kind.values()), 3),
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "launches": sum(n for _, _, n in rows),
            "top": [(name[:key_chars], round(ms, 3), n) for name, ms, n in rows[:top]]}


# -- A/B between checkouts -----------------------------------------------------------------
def _kv_sha(kv: torch.Tensor) -> str:
    """A digest of k/v's bits (bitwise comparison across trees / processes)."""
    import hashlib
    raw = kv.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


class _EagerGraph:
    """--smoke: a captured encode entry whose replay runs the entry's body eagerly."""

    def __init__(self, encoder, entry):
        self.encoder, self.entry = encoder, entry

    def replay(self):
        self.encoder._body(self.entry)


def child(tree: str, it: int, smoke: bool = False, encode_only: bool = False) -> dict:
    """One tree's figures (its photon_core is first on sys.path: see the imports).
    smoke: the tiny model on the CPU, wall-clock timers, no profiles (checks the plumbing).
    encode_only: only encode_image, its pieces and its k/v (no vision / prefill kernels)."""
    import inspect

    import photon_core
    from photon_core.fast import FastEngine
    from photon_core.task import Task
    global graph_ms, cuda_ms, profile_kinds
    out: dict = {"tree": tree, "photon_core": photon_core.__file__}
    if smoke:
        from photon_core.models.moondream2.test_model import tiny_config
        m = build_random_model(tiny_config(), device="cpu", dtype="fp32", seed=0)
        torch.cuda.synchronize = lambda *a, **k: None

        def graph_ms(fn, it):           # noqa: F811
            return wall_ms(fn, it)
        cuda_ms = graph_ms              # noqa: F811

        def profile_kinds(fn, top=6):   # noqa: F811
            return {"smoke": True}
    else:
        m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    v, w, t = m.config.vision, m.weights, m.config.text
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    detect = Task("detect", object="person", max_objects=5)
    has_kernels = "kernels" in inspect.signature(prefill_prefix).parameters
    with torch.inference_mode():
        _, x, _ = m.image_crops(frame)

        def vis():
            return vision_fused.encoder(w, v, x)
        if not encode_only:
            section(out, "vision_graph_ms", lambda: round(graph_ms(vis, it), 3))
            section(out, "vision_profile", lambda: profile_kinds(vis, top=4))
        if "triton" in getattr(vision_fused, "ATTENTION_FORMS", ()) and not encode_only:
            section(out, "vision_attention", lambda: vision_attention_probe(m, x, it, smoke))
        for n in (() if encode_only else (1, 4)):
            pre = torch.randn(n, m.prefix_len, t.dim, device=w.device, dtype=w.dtype,
                              generator=torch.Generator(w.device).manual_seed(n))
            kv = batched_encode.kv_buffer(m, n)

            def pf(pre=pre, kv=kv, **kw):
                return prefill_prefix(w, t, pre, kv, m.prefix_len, fast=True, **kw)
            section(out, f"prefill_n{n}_graph_ms", lambda: round(graph_ms(pf, it), 3))
            section(out, f"prefill_n{n}_profile", lambda: profile_kinds(pf, top=4))
            if has_kernels:      # the fast form without the fused kernels, same process
                section(out, f"prefill_n{n}_unfused_graph_ms", lambda: round(graph_ms(
                    lambda: pf(kernels=False), it), 3))
                if n == 1:
                    kv_ref = batched_encode.kv_buffer(m, n)
                    pf(kv=kv_ref, kernels=False)
                    pf()
                    section(out, "prefill_n1_kv_rel_diff_fused_vs_unfused",
                            lambda: _rel(kv, kv_ref))
        ref_kv = m.encode_image(frame).kv
    # smoke: the runtime's encode path (graphed_batch_encoder) on the CPU too
    fe = FastEngine(m, encoder="fast") if smoke else FastEngine(m)

    be = fe.batch_encoder
    if smoke and be is not None:    # the graph plumbing on the CPU: a "graph" runs its body
        be.use_graphs = True
        be._capture = lambda e, be=be: _EagerGraph(be, e)
        if hasattr(be, "crops_in_graph"):
            be.crops_in_graph = True
    # trees with the crops inside the encode graph (graphed_batch_encoder.crops_in_graph)
    in_graph = getattr(be, "crops_in_graph", None)
    out["crops_in_graph"] = in_graph

    def engine():
        res = {}
        e0 = fe.encode_image(frame)                              # captures
        res["kv_rel_diff_vs_reference"] = _rel(e0.kv, ref_kv)
        res["kv_sha_overlap"] = _kv_sha(e0.kv)
        res["encode_ms"] = round(wall_ms(lambda: fe.encode_image(frame), it), 3)
        g0 = fe.encode_image(frame, crops="global")
        res["kv_sha_global"] = _kv_sha(g0.kv)
        res["encode_global_ms"] = round(wall_ms(
            lambda: fe.encode_image(frame, crops="global"), it), 3)
        if in_graph:            # the same tree with the crops made outside the graph
            be.crops_in_graph = False
            try:
                e1 = fe.encode_image(frame)                      # captures
                g1 = fe.encode_image(frame, crops="global")
                res["kv_bitwise_in_graph_vs_eager_crops"] = bool(
                    torch.equal(e0.kv, e1.kv) and torch.equal(g0.kv, g1.kv))
                res["encode_eager_crops_ms"] = round(wall_ms(
                    lambda: fe.encode_image(frame), it), 3)
                res["encode_global_eager_crops_ms"] = round(wall_ms(
                    lambda: fe.encode_image(frame, crops="global"), it), 3)
            finally:
                be.crops_in_graph = True
        # four cameras of 640x480 in one encode (the live scheduler batches encodes)
        cams = [frame] + [np.random.default_rng(k).integers(0, 256, frame.shape,
                                                             dtype=np.uint8) for k in (1, 2, 3)]
        if hasattr(fe, "prepare_encode") and be is not None and be.max_frames >= 4:
            fe.prepare_encode(shapes=((480, 640),), batch_sizes=(4,))
            fe.encode_batch(cams)
            res["encode_batch4_ms_per_frame"] = round(wall_ms(
                lambda: fe.encode_batch(cams), it) / 4, 3)
        res["encode_detect5_ms"] = round(wall_ms(
            lambda: fe.run(fe.encode_image(frame), detect, ignore_eos=True), it), 3)
        res["encode_global_detect5_ms"] = round(wall_ms(
            lambda: fe.run(fe.encode_image(frame, crops="global"), detect, ignore_eos=True),
            it), 3)
        res["detect5_output"] = str(fe.run(fe.encode_image(frame), detect).output)[:120]
        return res
    section(out, "engine", engine)

    def pieces():
        """encode_image's pieces as the runtime runs them (graphed_batch_encoder.py)."""
        res = {}

        def single(crops_in_graph):
            return next((k, e) for k, e in be.entries.items()
                        if len(k) == 1 and k[0].crops == "overlap"
                        and (getattr(k[0], "size", None) is not None) == bool(crops_in_graph))
        key, entry = single(in_graph)
        with torch.inference_mode():
            res["crops_ms"] = round(wall_ms(lambda: m.image_crops(frame), it), 3)
            res["crops_profile"] = profile_kinds(lambda: m.image_crops(frame), top=4)
            res["graph_replay_ms"] = round(cuda_ms(entry.graph.replay, it), 3)
            res["kv_copy_out_ms"] = round(cuda_ms(lambda: entry.kv[:, :, 0:1].clone(), it), 3)
            if getattr(entry, "frames", None) is not None:   # the frame in, crops in graph
                part = [(0, frame, None, key[0])]
                res["frame_copy_in_ms"] = round(wall_ms(lambda: be._load(entry, part), it), 3)
                _, e_old = single(False)                    # captured by engine()
                res["graph_replay_eager_crops_ms"] = round(cuda_ms(e_old.graph.replay, it), 3)
                entry = e_old
            _, xx, _ = m.image_crops(frame)
            res["crops_copy_in_ms"] = round(cuda_ms(lambda: entry.x.copy_(xx), it), 3)
        return res
    section(out, "encode_pieces", pieces)
    fe.close()
    return out


def vision_attention_probe(m, x, it, smoke=False) -> dict:
    """ops/vision_attention.py vs SDPA at [9 crops, 16 heads, 729, 72], from a qkv GEMM
    output: 27 calls in one graph each (per config), the max rel diff to SDPA, and the whole
    vision encoder with attention="triton" (default config) as a graph + its rel diff."""
    from photon_core.ops.vision_attention import (TIMED_CONFIGS, vision_attention,
                                                  vision_attention_reference)
    v, w = m.config.vision, m.weights
    heads, layers = v.enc_n_heads, (1 if smoke else v.enc_n_layers)
    configs = TIMED_CONFIGS[:1] if smoke else TIMED_CONFIGS
    qkv = torch.randn(x.shape[0], 729, 3 * v.enc_dim, device=w.device, dtype=w.dtype,
                      generator=torch.Generator(w.device).manual_seed(9)) * 2
    ref = vision_attention_reference(qkv, heads)
    res = {"sdpa_27_calls_graph_ms": round(graph_ms(
        lambda: [vision_attention_reference(qkv, heads) for _ in range(layers)], it), 3)}
    for cfg in configs:
        name = "triton_%dx%d_w%d_s%d" % cfg
        try:
            res[name + "_rel_diff"] = _rel(vision_attention(qkv, heads, cfg), ref)
            res[name + "_27_calls_graph_ms"] = round(graph_ms(
                lambda cfg=cfg: [vision_attention(qkv, heads, cfg) for _ in range(layers)],
                it), 3)
        except Exception as e:  # noqa: BLE001
            res[name] = repr(e)[:200]
    best = min((k for k in res if k.endswith("_27_calls_graph_ms") and k.startswith("triton")),
               key=lambda k: res[k], default=None)
    res["best_triton"] = best
    if smoke:                   # the interpreter through 27 layers is too slow for a check
        return res
    enc_ref = vision_fused.encoder(w, v, x)

    def tri():
        return vision_fused.encoder(w, v, x, attention="triton")
    res["encoder_triton_rel_diff_vs_sdpa"] = _rel(tri(), enc_ref)
    res["encoder_triton_graph_ms"] = round(graph_ms(tri, it), 3)
    if best is not None:
        cfg = TIMED_CONFIGS[[("triton_%dx%d_w%d_s%d" % c) + "_27_calls_graph_ms"
                             for c in TIMED_CONFIGS].index(best)]
        res["encoder_triton_best_config"] = list(cfg)
        res["encoder_triton_best_graph_ms"] = round(graph_ms(
            lambda: vision_fused.encoder(w, v, x, attention="triton", attention_config=cfg),
            it), 3)
    return res


AB_ROWS = (("vision graph ms (9 crops)", ("vision_graph_ms",)),
           ("vision kernels: attention ms", ("vision_profile", "by_kind_ms", "attention")),
           ("vision kernels: norm ms", ("vision_profile", "by_kind_ms", "norm")),
           ("vision launches", ("vision_profile", "launches")),
           ("vision graph ms, attention=triton", ("vision_attention", "encoder_triton_graph_ms")),
           ("  best config", ("vision_attention", "encoder_triton_best_graph_ms")),
           ("vision attention x27 graph ms, SDPA", ("vision_attention",
                                                   "sdpa_27_calls_graph_ms")),
           ("vision attention x27 graph ms, triton default", (
               "vision_attention", "triton_128x64_w8_s3_27_calls_graph_ms")),
           ("vision encoder rel diff triton vs sdpa", ("vision_attention",
                                                      "encoder_triton_rel_diff_vs_sdpa")),
           ("prefill graph ms, 1 frame", ("prefill_n1_graph_ms",)),
           ("  same tree, kernels=False", ("prefill_n1_unfused_graph_ms",)),
           ("prefill elementwise ms, 1 frame", ("prefill_n1_profile", "by_kind_ms",
                                                "elementwise")),
           ("prefill launches, 1 frame", ("prefill_n1_profile", "launches")),
           ("prefill graph ms, 4 frames", ("prefill_n4_graph_ms",)),
           ("  same tree, kernels=False", ("prefill_n4_unfused_graph_ms",)),
           ("prefill elementwise ms, 4 frames", ("prefill_n4_profile", "by_kind_ms",
                                                 "elementwise")),
           ("encode_image 640x480 ms (FastEngine defaults)", ("engine", "encode_ms")),
           ("  same tree, crops outside the graph", ("engine", "encode_eager_crops_ms")),
           ("encode_image crops=global ms", ("engine", "encode_global_ms")),
           ("  same tree, crops outside the graph", ("engine",
                                                     "encode_global_eager_crops_ms")),
           ("encode_batch 4 x 640x480 ms per frame", ("engine", "encode_batch4_ms_per_frame")),
           ("encode + detect(5) ms", ("engine", "encode_detect5_ms")),
           ("encode global + detect(5) ms", ("engine", "encode_global_detect5_ms")),
           ("  piece: crops on the GPU ms (eager)", ("encode_pieces", "crops_ms")),
           ("  piece: crops copy-in ms (eager crops)", ("encode_pieces", "crops_copy_in_ms")),
           ("  piece: frame copy-in ms (crops in graph)", ("encode_pieces",
                                                          "frame_copy_in_ms")),
           ("  piece: encode graph replay ms (default)", ("encode_pieces", "graph_replay_ms")),
           ("  piece: graph replay ms, eager-crops graph", ("encode_pieces",
                                                           "graph_replay_eager_crops_ms")),
           ("  piece: k/v copy-out ms", ("encode_pieces", "kv_copy_out_ms")),
           ("k/v max rel diff vs reference encode", ("engine", "kv_rel_diff_vs_reference")),
           ("prefill k/v rel diff fused vs unfused", ("prefill_n1_kv_rel_diff_fused_vs_unfused",)))


def _get(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _write_ab(runs: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "probe_encode_ab.json").write_text(
            json.dumps(runs, indent=1, default=str))


def ab(trees: list[str], rounds: int, it: int, smoke: bool = False,
       child_timeout: float = 900, encode_only: bool = False) -> None:
    import subprocess
    from statistics import median
    runs: dict[str, list] = {tr: [] for tr in trees}
    for rnd in range(rounds):
        for tree in trees:
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--child", tree, "--iters",
                                    str(it)] + (["--smoke"] if smoke else [])
                                   + (["--encode-only"] if encode_only else []),
                                   capture_output=True, text=True, timeout=child_timeout)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                res = json.loads(line[-1][7:]) if line else {"error": p.stderr[-3000:]}
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                res = {"error": f"timed out after {child_timeout} s", "partial": out[-3000:]}
            res["child_s"] = round(time.perf_counter() - t0, 1)
            runs[tree].append(res)
            say(json.dumps({"round": rnd, **res}))
            _write_ab(runs)
    say("")
    say("| 640x480, bf16, real shapes, median of rounds | " + " | ".join(trees)
        + (" | last / first |" if len(trees) > 1 else " |"))
    say("|---|" + "---|" * (len(trees) + (len(trees) > 1)))
    for label, path in AB_ROWS:
        vals = []
        for tr in trees:
            xs = [_get(r, path) for r in runs[tr]]
            xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
            vals.append(round(median(xs), 4) if xs else None)
        ratio = (f" | {vals[-1] / vals[0]:.3f}" if len(vals) > 1 and vals[0] and
                 vals[-1] is not None else (" | -" if len(trees) > 1 else ""))
        say(f"| {label} | " + " | ".join(str(v) for v in vals) + ratio + " |")
    for tr in trees:
        say(f"{tr}: detect(5) output {[_get(r, ('engine', 'detect5_output')) for r in runs[tr]]}")
        say(f"{tr}: crops in graph {[r.get('crops_in_graph') for r in runs[tr]]}, k/v bitwise "
            "in-graph crops = eager crops (same tree) "
            f"{[_get(r, ('engine', 'kv_bitwise_in_graph_vs_eager_crops')) for r in runs[tr]]}")
    for mode in ("overlap", "global"):
        shas = {tr: {_get(r, ("engine", f"kv_sha_{mode}")) for r in runs[tr]} for tr in trees}
        same = len(set().union(*shas.values())) == 1 and None not in set().union(*shas.values())
        say(f"k/v sha256 ({mode}) per tree {shas}: bitwise the same across trees: {same}")
    enc = [_get(r, ("engine", "encode_ms")) for r in runs[trees[-1]]]
    enc = [x for x in enc if isinstance(x, (int, float))]
    if enc:
        say(f"issue 13 target 640x480 encode <= 14 ms ({trees[-1]}): {median(enc):.2f} ms")
    _write_ab(runs)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_encode_ab.md").write_text("\n".join(LINES) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode of the compile sections, e.g. "
                    "max-autotune-no-cudagraphs (Triton GEMM templates against cuBLAS)")
    ap.add_argument("--only", default="",
                    help="comma-separated section names to run (default: all), e.g. "
                    "vision_graph_ms,gemm_rates,gemm_rates_compiled,vision_torch_compile")
    ap.add_argument("--ab", nargs="+", metavar="TREE",
                    help="A/B of these checkouts' encode, each in a subprocess")
    ap.add_argument("--rounds", type=int, default=1, help="--ab: runs per tree, alternating")
    ap.add_argument("--child-timeout", type=float, default=900,
                    help="--ab: seconds one tree's subprocess may run")
    ap.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="--ab on the CPU with the tiny model (plumbing check, no timings)")
    ap.add_argument("--encode-only", action="store_true",
                    help="--ab: encode_image, its pieces and k/v only (no vision / prefill "
                    "kernel sections): a few minutes for two trees")
    args = ap.parse_args()
    it = args.iters
    if args.ab:
        ab(args.ab, args.rounds, it, args.smoke, args.child_timeout, args.encode_only)
        return
    if args.child:
        print("RESULT " + json.dumps(child(args.child, it, args.smoke, args.encode_only),
                                     default=str), flush=True)
        return
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                 "date": time.strftime("%Y-%m-%d")}
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    v, w, t = m.config.vision, m.weights, m.config.text
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    only = set(filter(None, args.only.split(",")))
    mode = args.compile_mode

    def part(name, fn):                         # section(), filtered by --only
        if not only or name in only:
            section(out, name, fn)
    with torch.inference_mode():
        _, x, _ = m.image_crops(frame)
        out["crops"] = int(x.shape[0])

        def vis():
            return vision_fused.encoder(w, v, x)

        part("vision_graph_ms", lambda: round(graph_ms(vis, it), 3))
        part("vision_profile", lambda: profile_kinds(vis))
        for n in (1, 4):
            pre = torch.randn(n, m.prefix_len, t.dim, device="cuda", dtype=w.dtype)
            kv = batched_encode.kv_buffer(m, n)

            def pf(pre=pre, kv=kv):
                return prefill_prefix(w, t, pre, kv, m.prefix_len, fast=True)
            part(f"prefill_n{n}_graph_ms", lambda: round(graph_ms(pf, it), 3))
            part(f"prefill_n{n}_profile", lambda: profile_kinds(pf))

        def sdpa_pad():
            res = {}
            n, h, s, d = x.shape[0], v.enc_n_heads, 729, v.enc_dim // v.enc_n_heads
            q, k, vv = (torch.randn(n, h, s, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3))
            ref = F.scaled_dot_product_attention(q, k, vv)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for pad in (d, 80, 96, 128):
                qp, kp, vp = (F.pad(z, (0, pad - d)) for z in (q, k, vv))
                for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        with sdpa_kernel(getattr(SDPBackend, be)):
                            def f():
                                return F.scaled_dot_product_attention(
                                    qp, kp, vp, scale=d ** -0.5)[..., :d]
                            diff = (f().float() - ref.float()).abs().max().item()
                            res[f"d{pad}_{be[:5].lower()}"] = {
                                "ms_27_layers": round(cuda_ms(f, it) * v.enc_n_layers, 3),
                                "max_diff": round(diff, 4)}
                    except Exception as e:  # noqa: BLE001
                        res[f"d{pad}_{be[:5].lower()}"] = repr(e)[:100]
            return res
        part("vision_sdpa_padded", sdpa_pad)

        def gemms():
            res = {}
            shapes = {"vision": (x.shape[0] * 729, [(1152, 3456), (1152, 1152), (1152, 4304),
                                                    (4304, 1152)]),
                      "prefill_730": (730, [(2048, 6144), (2048, 2048), (2048, 8192),
                                            (8192, 2048)]),
                      "prefill_2920": (2920, [(2048, 6144), (2048, 2048), (2048, 8192),
                                              (8192, 2048)])}
            for label, (mrows, kn) in shapes.items():
                for kdim, ndim in kn:
                    a = torch.randn(mrows, kdim, device="cuda", dtype=torch.bfloat16)
                    wt = torch.randn(ndim, kdim, device="cuda", dtype=torch.bfloat16)
                    b = torch.randn(ndim, device="cuda", dtype=torch.bfloat16)
                    ms = cuda_ms(lambda: F.linear(a, wt, b), it)
                    res[f"{label}_{kdim}x{ndim}"] = {
                        "ms": round(ms, 4), "tflops": round(2 * mrows * kdim * ndim / ms / 1e9, 1)}
            return res
        part("gemm_rates", gemms)

        def gemms_compiled():
            """The vision GEMMs (and fc1's GELU) through torch.compile(mode=--compile-mode)
            against F.linear (cuBLAS) in the same run: under max-autotune, Inductor times its
            Triton GEMM templates against cuBLAS per shape and keeps the faster."""
            res = {}
            lin = torch.compile(lambda a, wt, b: F.linear(a, wt, b), mode=mode, dynamic=False)
            lin_gelu = torch.compile(lambda a, wt, b: F.gelu(F.linear(a, wt, b),
                                                             approximate="tanh"),
                                     mode=mode, dynamic=False)
            vis_rows, pre_rows = x.shape[0] * 729, m.prefix_len
            for mrows, kdim, ndim, gelu in (
                    (vis_rows, 1152, 3456, False), (vis_rows, 1152, 1152, False),
                    (vis_rows, 1152, 4304, True), (vis_rows, 4304, 1152, False),
                    (pre_rows, 2048, 6144, False), (pre_rows, 2048, 2048, False),
                    (pre_rows, 2048, 8192, True), (pre_rows, 8192, 2048, False)):
                a = torch.randn(mrows, kdim, device="cuda", dtype=torch.bfloat16)
                wt = torch.randn(ndim, kdim, device="cuda", dtype=torch.bfloat16) / 30
                b = torch.randn(ndim, device="cuda", dtype=torch.bfloat16)
                fn = lin_gelu if gelu else lin
                t0 = time.perf_counter()
                y = fn(a, wt, b)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                ref = F.linear(a, wt, b)
                if gelu:
                    ref = F.gelu(ref, approximate="tanh")
                flop = 2 * mrows * kdim * ndim
                eager = cuda_ms(lambda: F.gelu(F.linear(a, wt, b), approximate="tanh")
                                if gelu else F.linear(a, wt, b), it)
                comp = cuda_ms(lambda: fn(a, wt, b), it)
                res[f"{mrows}x{kdim}x{ndim}{'_gelu' if gelu else ''}"] = {
                    "eager_ms": round(eager, 4), "compiled_ms": round(comp, 4),
                    "eager_tflops": round(flop / eager / 1e9, 1),
                    "compiled_tflops": round(flop / comp / 1e9, 1),
                    "compile_s": round(secs, 1),
                    "rel_diff": round(((y.float() - ref.float()).norm()
                                       / ref.float().norm()).item(), 5)}
            return res
        part("gemm_rates_compiled", gemms_compiled)

        if not args.no_compile:
            def compiled():
                t0 = time.perf_counter()
                cf = torch.compile(vision_fused.encoder, mode=mode)
                y = cf(w, v, x, fuse_norms=False)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                ref = vis()
                rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                return {"mode": mode, "compile_s": round(secs, 1),
                        "compiled_graph_ms": round(graph_ms(
                            lambda: cf(w, v, x, fuse_norms=False), it), 3),
                        "eager_graph_ms": round(graph_ms(vis, it), 3),
                        "rel_diff": round(rel, 5)}
            part("vision_torch_compile", compiled)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_encode.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
