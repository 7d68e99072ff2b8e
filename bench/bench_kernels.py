"""Fused decode-step kernels on the GPU (photon_core/ops, fast/fused_backend.py) vs the
cuBLAS fast path, all in one run, real Moondream 2 shapes, random bf16 weights.

  1. copy bandwidth (device-to-device, read + write);
  2. GEMV sweep: every candidate config of kernels/gemv.py per decode shape
     ([qkv|fc1] 14336x2048 + GELU, [proj|fc2] 2048x10240 into the fp32 residual, lm_head
     51200x2048) at batch 1/2/4/8, against cuBLAS (F.linear) doing the same work the
     previous step did; distinct weight copies rotate so L2 never holds them; timed as CUDA
     graphs of back-to-back launches; each config's output diffed against fp32 torch. The
     fastest config per (shape, batch 1 | batch > 1) goes into gemv.TABLE for step 4;
  3. the decode attention kernel alone (rope + KV write + split attention + combine);
  4. the decode step: previous fast path (EngineOptions fused="off", cuBLAS + SDPA) vs fused,
     graph replay (lm + forward) at batch 1/2/4/8 and the pipelined loop at 1 and 8, the
     bandwidth floor, kernels per step (profiler);
  5. GPU correctness, bf16: logits of the same state (fused vs previous), greedy tokens of
     query(32) and detect / point outputs on a 640x480 frame, fused vs previous.

Usage: PYTHONPATH=. python3 bench/bench_kernels.py [--kv 832] [--no-sweep]
Writes $OUT/bench_kernels.json and $OUT/bench_kernels.md when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms as graph_replay_ms  # noqa: E402
from bench.bench_decode import (copy_bandwidth, decoder_weight_bytes, graph_step_ms,  # noqa: E402
                                kv_bytes, loop_step, profile_step)
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.fast import decode_step as ds  # noqa: E402
from photon_core.ops import gemv as G  # noqa: E402
from photon_core.moondream.config import MoondreamConfig  # noqa: E402
from photon_core.moondream.model import build_random_model  # noqa: E402
from photon_core.task import Task  # noqa: E402

LINES: list[str] = []
OUT: dict = {}


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


def graph_ms(fn, reps=20):
    """fn launches a fixed sequence; time it captured in one CUDA graph (median ms)."""
    return graph_replay_ms(fn, calls=1, replays=reps)


SHAPES = {  # name: (n, k, epi, cuBLAS split of the previous step)
    "qkv|fc1 +gelu": (14336, 2048, G.EPI_QKV_GELU),
    "proj|fc2 +res": (2048, 10240, G.EPI_RESIDUAL),
    "lm_head": (51200, 2048, G.EPI_STORE),
}


def _compile_job(job):
    n, k, epi, b, cfg = job
    try:
        x = torch.zeros(b, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.zeros(n, device="cuda", dtype=torch.float32 if epi == G.EPI_RESIDUAL
                           else torch.bfloat16)
        y = torch.zeros(b, n + 2048, device="cuda", dtype=torch.float32
                        if epi == G.EPI_RESIDUAL else torch.bfloat16)
        G.gemv(x, w, bias, y[:, :n] if epi == G.EPI_RESIDUAL else y, epi, n_split=6144,
               gap=2048, cfg=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return repr(e)[:200]


def precompile(workers=12):
    """Compile every candidate in parallel processes (Triton's disk cache is shared), so the
    sweep in this process only loads binaries."""
    import multiprocessing as mp
    jobs = []
    for n, k, epi in SHAPES.values():
        for cfg in G.CANDIDATES:
            for b in (1, 2):
                if cfg.fits(b, n, k, epi) and (b == 1 or cfg.dot):
                    jobs.append((n, k, epi, b, cfg))
                    break
    with mp.get_context("spawn").Pool(workers) as pool:
        errs = [e for e in pool.map(_compile_job, jobs, chunksize=1) if e]
    return len(jobs), errs


def sweep(bw):
    dev, dt = "cuda", torch.bfloat16
    res = {}
    for name, (n, k, epi) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(2, -(-400_000_000 // wbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device=dev, dtype=dt if epi != G.EPI_RESIDUAL else torch.float32)
        for b in (1, 2, 4, 8):
            x = torch.randn(b, k, device=dev, dtype=dt)
            floor_us = wbytes / bw * 1e6
            # cuBLAS: the previous step's ops for the same work
            if epi == G.EPI_QKV_GELU:
                def cub(w):
                    q = F.linear(x, w[:6144], bias[:6144])
                    g = F.gelu(F.linear(x, w[6144:], bias[6144:]), approximate="tanh")
                    return q, g
            elif epi == G.EPI_RESIDUAL:
                xres = torch.randn(b, n, device=dev, dtype=dt)
                bb = bias.to(dt)

                def cub(w):
                    return xres + F.linear(x[:, :2048], w[:, :2048], bb) + F.linear(
                        x[:, 2048:], w[:, 2048:], bb)
            else:
                def cub(w):
                    return F.linear(x, w, bias)
            ws_split = ws
            if epi == G.EPI_RESIDUAL:   # cuBLAS needs the two halves contiguous, as before
                ws_split = [(w[:, :2048].contiguous(), w[:, 2048:].contiguous()) for w in ws]

                def cub(w, xres=xres, bb=bias.to(dt)):  # noqa: F811
                    return xres + F.linear(x[:, :2048], w[0], bb) + F.linear(x[:, 2048:], w[1], bb)
            t_cub = graph_ms(lambda: [cub(w) for w in ws_split]) / copies * 1e3
            row = {"floor_us": floor_us, "cublas_us": t_cub, "configs": {}}
            ref = F.linear(x.float(), ws[0].float(), bias.float())
            for cfg in G.CANDIDATES:
                if not cfg.fits(b, n, k, epi):
                    continue
                width = n + (2048 if epi == G.EPI_QKV_GELU else 0)
                y = torch.zeros(b, width, device=dev,
                                dtype=torch.float32 if epi == G.EPI_RESIDUAL else dt)
                try:
                    G.gemv(x, ws[0], bias, y, epi, n_split=6144, gap=2048, cfg=cfg)
                    torch.cuda.synchronize()
                    if epi == G.EPI_QKV_GELU:
                        got = torch.cat([y[:, :6144].float(), y[:, 8192:].float()], 1)
                        want = torch.cat([ref[:, :6144], F.gelu(ref[:, 6144:],
                                                                approximate="tanh")], 1)
                    else:
                        got, want = y.float(), ref
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    t = graph_ms(lambda: [G.gemv(x, w, bias, y, epi, n_split=6144, gap=2048,
                                                 cfg=cfg) for w in ws]) / copies * 1e3
                    row["configs"][str(cfg)] = {"us": t, "rel_err": err, "cfg": cfg}
                except Exception as e:  # noqa: BLE001
                    row["configs"][str(cfg)] = {"error": repr(e)[:300]}
            ok = {c: v for c, v in row["configs"].items() if "us" in v and v["rel_err"] < 2e-2}
            best = min(ok, key=lambda c: ok[c]["us"]) if ok else None
            row["best"] = best
            res[(name, b)] = row
            if best:
                bt = ok[best]["us"]
                say(f"| {name} | {b} | {floor_us:.1f} | {t_cub:.1f} ({floor_us / t_cub * 100:.0f}%) "
                    f"| {bt:.1f} ({floor_us / bt * 100:.0f}%) | {t_cub / bt:.2f}x | {best} | "
                    f"{ok[best]['rel_err']:.1e} |")
            else:
                say(f"| {name} | {b} | {floor_us:.1f} | {t_cub:.1f} | no valid config | "
                    f"{row['configs']} |")
        del ws
        torch.cuda.empty_cache()
    # pick per (shape, b == 1) and (shape, b > 1: best summed over 2/4/8)
    for name, (n, k, epi) in SHAPES.items():
        r1 = res[(name, 1)]
        if r1["best"]:
            G.TABLE[(n, k, epi, True)] = r1["configs"][r1["best"]]["cfg"]
        tot = {}
        for b in (2, 4, 8):
            for c, v in res[(name, b)]["configs"].items():
                if "us" in v and v["rel_err"] < 2e-2:
                    tot.setdefault(c, [0.0, 0, v["cfg"]])
                    tot[c][0] += v["us"]
                    tot[c][1] += 1
        full = {c: v for c, v in tot.items() if v[1] == 3}
        if full:
            c = min(full, key=lambda c: full[c][0])
            G.TABLE[(n, k, epi, False)] = full[c][2]
    say("chosen: " + "; ".join(f"{k}: {v}" for k, v in G.TABLE.items()))
    return {f"{k[0]}|b{k[1]}": {**v, "configs": {c: {kk: vv for kk, vv in d.items() if kk != "cfg"}
                                                  for c, d in v["configs"].items()}}
            for k, v in res.items()}


def attention_alone(model, kv_cap):
    from photon_core.fast.fused_backend import FusedBackend
    from photon_core.fast.static_kv_cache import StaticKVCache
    from photon_core.ops.decode_attention import AttentionScratch, decode_attention
    cfg = model.config.text
    kv = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, 8, kv_cap, cfg.head_dim, "cuda",
                       torch.bfloat16)
    kv.data.normal_()
    fd = FusedBackend(model.step_spec(), model.weights, kv, 8)
    u = fd.bufs["u"]
    u.normal_()
    a_off = fd.program.segment("a")[1]
    out = {}
    for chunk, fuse in ((64, False), (128, False), (128, True), (256, True)):
        sc = AttentionScratch(8, cfg.n_heads, cfg.head_dim, kv_cap, chunk, "cuda")
        for b in (1, 8):
            pos = torch.full((b,), 785, device="cuda", dtype=torch.long)
            t = graph_ms(lambda: [decode_attention(
                u[:b], pos, fd.cos, fd.sin, kv.data[i, 0], kv.data[i, 1],
                u[:b, a_off:], sc, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, fuse)
                for i in range(cfg.n_layers)]) / cfg.n_layers * 1e3
            out[f"chunk{chunk}_{'fusedcombine' if fuse else 'combinekernel'}_b{b}"] = t
    del fd, kv
    torch.cuda.empty_cache()
    return out


def correctness(prev, fused, model, frame):
    res = {}
    enc = prev.encode_image(frame)
    # same state: prefill one query row in each engine, one lm step, compare logits
    t = Task("query", question="What is in the image?", max_tokens=40)
    r_p = prev.start(enc, t, ignore_eos=True)
    r_f = fused.start(enc, t, ignore_eos=True)
    torch.cuda.synchronize()
    with torch.inference_mode():
        lp = ds._lm_logits(prev.state, 1).float().clone()
        lf = ds._lm_logits(fused.state, 1).float().clone()
        fused.state.active.zero_()
        prev.state.active.zero_()
        # one forward from the same hidden/pos and the same fed-back token
        tok = lp.argmax().item()
        for e in (prev, fused):
            e.state.out[:1] = torch.tensor([[tok, 0, 0, 0]], device=e.state.out.device)
        prev.state.active[:1] = True
        fused.state.active[:1] = True
        ds.forward(prev.state, 1)
        ds.forward(fused.state, 1)
        hp, hf = prev.state.hidden[:1].float(), fused.state.hidden[:1].float()
        lp2 = ds._lm_logits(prev.state, 1).float()
        lf2 = ds._lm_logits(fused.state, 1).float()
    def rel(a, b):
        ok = torch.isfinite(a) & torch.isfinite(b)
        return ((a[ok] - b[ok]).abs().max() / a[ok].abs().max()).item()
    # fp32 truth for the same step: the reference decoder (text.decoder) with the bf16 weights
    # upcast, over the row's cache (prefill k/v) upcast, at the row's position
    try:
        from photon_core.moondream import text
        from photon_core.moondream.kv_cache import KVCache
        from photon_core.moondream.layers import Weights
        w32 = Weights({k: v.float() for k, v in model.weights.items()})
        tc = model.config.text
        p0 = int(prev.state.pos[0]) - 1          # the position the step just wrote
        cache = KVCache(tc.n_layers, tc.n_kv_heads, prev.kv.capacity, tc.head_dim, prev.kv.data.device,
                        torch.float32)
        cache.data.copy_(prev.kv.data[:, :, 0:1].float())
        x32 = w32["text.wte"][tok][None, None]
        with torch.inference_mode():
            h32 = text.decoder(w32, tc, x32, p0, cache, model.prefix_len)[0, 0]
            l32 = text.lm_head(w32, h32[None])[0]
        for name, h, lg in (("previous", hp[0], lp2[0]), ("fused", hf[0], lf2[0])):
            res[f"vs_fp32_{name}"] = {"hidden_rel_max": rel(h32, h),
                                      "hidden_rel_rms": ((h - h32).norm() / h32.norm()).item(),
                                      "logits_rel_max": rel(l32, lg),
                                      "argmax_equal": bool(l32.argmax() == lg.argmax())}
        del w32, cache
    except Exception:  # noqa: BLE001
        res["vs_fp32_error"] = traceback.format_exc()[-600:]
    res["logits_prefill_rel"] = rel(lp, lf)
    res["hidden_after_step_rel"] = rel(hp, hf)
    res["logits_after_step_rel"] = rel(lp2, lf2)
    res["argmax_equal_after_step"] = bool(lp2.argmax() == lf2.argmax())
    for r in (r_p, r_f):
        r.cancel("cancelled")
    prev.drain()
    fused.drain()
    outs = {}
    for name, task in {"query32": Task("query", question="What is in the image?",
                                       max_tokens=32),
                       "detect5": Task("detect", object="person", max_objects=5),
                       "point5": Task("point", object="person", max_objects=5)}.items():
        a = prev.run(enc, task, ignore_eos=True)
        b = fused.run(enc, task, ignore_eos=True)
        outs[name] = {"identical": a.output == b.output, "prev": str(a.output)[:300],
                      "fused": str(b.output)[:300]}
    res["outputs"] = outs
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", type=int, default=832)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    import triton
    say(f"# bench_kernels  {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}  kv {args.kv}")
    bw = copy_bandwidth()
    OUT["copy_bw_TBps"] = bw / 1e12
    say(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    if not args.no_sweep:
        say("\n| shape | batch | floor us | cuBLAS us (% of copy bw) | best Triton us (%) | "
            "cuBLAS / Triton | config | rel err |")
        say("|---|---|---|---|---|---|---|---|")
        t0 = time.perf_counter()
        try:
            n_jobs, errs = precompile()
            say(f"precompiled {n_jobs} GEMV variants in {time.perf_counter() - t0:.0f} s, "
                f"errors: {errs[:3]}")
            OUT["sweep"] = sweep(bw)
        except Exception:  # noqa: BLE001
            say("sweep failed: " + traceback.format_exc())
        say(f"sweep took {time.perf_counter() - t0:.0f} s")
    model = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    try:
        OUT["attention_us_per_layer"] = attention_alone(model, args.kv)
        say(f"decode attention (rope + KV write + split attn + combine), us per layer at "
            f"pos 785: {OUT['attention_us_per_layer']}")
    except Exception:  # noqa: BLE001
        say("attention failed: " + traceback.format_exc())
    engines = {}
    for mode in ("off", "on"):
        t0 = time.perf_counter()
        engines[mode] = FastEngine(model, max_batch=8, kv_capacity=args.kv, fused=mode,
                                    megakernel="off")
        say(f"engine fused={mode}: build + capture {time.perf_counter() - t0:.1f} s")
    prev, fused = engines["off"], engines["on"]
    assert fused.state.fused is not None and prev.state.fused is None
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    try:
        OUT["correctness"] = correctness(prev, fused, model, frame)
        say(f"correctness (bf16, fused vs previous): {json.dumps(OUT['correctness'], default=str)}")
    except Exception:  # noqa: BLE001
        say("correctness failed: " + traceback.format_exc())
    wbytes = decoder_weight_bytes(model)
    enc = prev.encode_image(frame)
    say("\n| batch | floor ms | previous graph ms (x floor) | fused graph ms (x floor) | "
        "prev / fused | previous pipelined ms | fused pipelined ms (x floor) |")
    say("|---|---|---|---|---|---|---|")
    dec = {}
    for b in (1, 2, 4, 8):
        try:
            gp = graph_step_ms(prev, b)
            gf = graph_step_ms(fused, b)
            row = {"prev_graph_ms": gp, "fused_graph_ms": gf}
            if b in (1, 8):
                pp = loop_step(prev, enc, b, pipelined=True)
                pf = loop_step(fused, enc, b, pipelined=True)
                pos = [int(x) for x in pf["positions"]]
                row.update(prev_pipelined=pp, fused_pipelined=pf)
            else:
                pos = [785] * b
            floor = (wbytes + kv_bytes(model.config, pos)) / bw * 1e3
            row["floor_ms"] = floor
            dec[b] = row
            ps = (f"{row['prev_pipelined']['wall_ms_per_step']:.3f} | "
                  f"{row['fused_pipelined']['wall_ms_per_step']:.3f} "
                  f"({row['fused_pipelined']['wall_ms_per_step'] / floor:.2f})") \
                if "prev_pipelined" in row else "- | -"
            say(f"| {b} | {floor:.3f} | {gp:.3f} ({gp / floor:.2f}) | {gf:.3f} ({gf / floor:.2f}) "
                f"| {gp / gf:.2f} | {ps} |")
        except Exception:  # noqa: BLE001
            say(f"step b={b} failed: " + traceback.format_exc())
    OUT["decode"] = dec
    for name, eng in (("previous", prev), ("fused", fused)):
        try:
            prof = profile_step(eng)
            OUT[f"profile_{name}"] = prof
            say(f"profile {name} (eager lm+forward, b=1): " + "; ".join(
                f"{k[:60]} {v:.1f}" for k, v in prof[:10]))
        except Exception:  # noqa: BLE001
            say(f"profile {name} failed: " + traceback.format_exc())
    for e in engines.values():
        e.close()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kernels.json").write_text(
            json.dumps(OUT, indent=1, default=str))
        Path(os.environ["OUT"], "bench_kernels.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
