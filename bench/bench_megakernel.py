"""Megakernel backend (photon_core/megakernel) vs the fused backend on the GPU, Moondream 2
shapes, random bf16 weights. Every kernel run happens in a child process under a timeout
(a watchdog: a deadlocked persistent kernel cannot hang the run).

Phases (each a child process; the parent prints a summary and never waits past --timeout):
  compile-cold  fresh TRITON_CACHE_DIR: build + first launch of the megakernel (b=1) = compile
  compile-warm  same cache dir, new process: the cached start
  bench         in one process, all against same-run baselines:
                - copy bandwidth -> floor = (decoder weights + k/v at pos 785) / bandwidth
                - greedy diff, deterministic mode, b=1 and b=8, 64 steps: fused backend
                  (feed, decoder, advance, lm_greedy) vs megakernel (feed + one launch),
                  from the same state: tokens identical per step, max |hidden| diff
                - step ms at b=1 and b=8: megakernel (feed + kernel; direct launches and, if
                  capturable, a CUDA graph) vs the fused backend's graph replay (lm + forward)

Usage: PYTHONPATH=. python3 bench/bench_megakernel.py [--timeout 540] [--steps 64]
Writes $OUT/bench_megakernel.json and .md when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KV = 832
POS = 785


def say(s=""):
    print(s, flush=True)


# ---------------------------------------------------------------- child side
def _setup(b_max=8):
    import torch

    from photon_core.fast import FastEngine
    from photon_core.moondream.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model

    torch.manual_seed(0)
    model = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    eng = FastEngine(model, max_batch=b_max, kv_capacity=KV, deterministic=True,
                     graphed_prefill=False, graphed_encoder=False, detok_thread=False)
    assert eng.state.fused is not None and eng.state.fused.deterministic
    return torch, model, eng


def _state_for(torch, eng, b, seed=1):
    """rows [0, b): text phase, first pick done, active, positions POS - r, k/v random."""
    st = eng.state
    g = torch.Generator(device="cuda").manual_seed(seed)
    eng.kv.data.normal_(generator=g)
    st.hidden.normal_(generator=g)
    st.pos.zero_()
    st.pos[:b] = torch.arange(POS, POS - b, -1, device="cuda")
    st.phase.zero_()
    st.first.zero_()
    st.active.zero_()
    st.active[:b] = True
    st.out.zero_()


def _snap(eng):
    st, fd = eng.state, eng.state.fused
    return {n: getattr(st, n).clone() for n in ("hidden", "pos", "phase", "first", "active",
                                                "out")} | {"kv": eng.kv.data.clone(),
                                                           "x": fd.x.clone()}


def _restore(eng, s):
    st, fd = eng.state, eng.state.fused
    for n in ("hidden", "pos", "phase", "first", "active", "out"):
        getattr(st, n).copy_(s[n])
    eng.kv.data.copy_(s["kv"])
    fd.x.copy_(s["x"])


def child_compile(args):
    t0 = time.perf_counter()
    torch, model, eng = _setup(1)
    from photon_core.megakernel.megakernel_step import MegakernelStep
    t1 = time.perf_counter()
    mk = MegakernelStep(eng.state.fused, eng.state, 1)
    t2 = time.perf_counter()
    eng.state.active.zero_()
    mk.run_kernel()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    c = mk.compiled
    print("RESULT " + json.dumps({
        "setup_s": t1 - t0, "schedule_s": t2 - t1, "first_launch_s": t3 - t2,
        "instructions": len(c.instrs), "programs": c.n_programs, "aligned": c.aligned,
        "est_makespan_us": c.makespan_us}), flush=True)


def _cuda_ms(torch, fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(a.elapsed_time(e))
    return statistics.median(ts)


def _graph_ms(torch, fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _cuda_ms(torch, g.replay, iters=reps), g


def child_bench(args):
    res = {}
    torch, model, eng = _setup(8)
    from photon_core.megakernel.megakernel_step import MegakernelStep
    st, fd = eng.state, eng.state.fused
    eng.runner.capture()
    answer = model.config.tokenizer.answer_id
    # copy bandwidth and the floor
    n = 2 ** 30
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ms = _cuda_ms(torch, lambda: c.copy_(a), iters=20)
    bw = 2 * a.numel() * 2 / (ms * 1e-3)
    del a, c
    torch.cuda.empty_cache()
    w = model.weights
    wbytes = sum(t.numel() * t.element_size() for nm, t in w.items()
                 if nm.startswith("text.") and nm != "text.wte")
    t = model.config.text
    res["copy_TBps"] = bw / 1e12
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s; decoder weights {wbytes / 1e9:.2f} GB")
    for b in (1, 8):
        row = {}
        try:
            t0 = time.perf_counter()
            mk = MegakernelStep(fd, st, b)
            cmp = mk.compiled
            row.update(instructions=len(cmp.instrs), programs=cmp.n_programs,
                       aligned=cmp.aligned, est_makespan_us=round(cmp.makespan_us, 1))
            # --- greedy diff, deterministic mode
            _state_for(torch, eng, b)
            fd.lm_greedy(st.hidden[:b], st.out, st.phase, st.first, answer, b)
            s0 = _snap(eng)
            ref_tok, ref_h = [], []
            for _ in range(args.steps):
                fd.feed(st.out, st.phase, b)
                fd.decoder(None, st.pos[:b], b)
                fd.advance(st, b)
                fd.lm_greedy(st.hidden[:b], st.out, st.phase, st.first, answer, b)
                ref_tok.append(st.out[:b, 0].clone())
                ref_h.append(st.hidden[:b].clone())
            torch.cuda.synchronize()
            _restore(eng, s0)
            mk.step()                            # first launch: compile (b=8) or cache
            torch.cuda.synchronize()
            row["first_launch_s"] = round(time.perf_counter() - t0, 2)
            _restore(eng, s0)
            first_bad, hdiff = None, 0.0
            for k in range(args.steps):
                mk.step()
                if first_bad is None and not torch.equal(st.out[:b, 0], ref_tok[k]):
                    first_bad = k
                hdiff = max(hdiff, (st.hidden[:b].float() - ref_h[k].float()).abs().max()
                            .item())
            torch.cuda.synchronize()
            row["greedy_steps"] = args.steps
            row["tokens_identical"] = first_bad is None
            row["first_divergent_step"] = first_bad
            row["max_hidden_diff"] = hdiff
            row["counters_reset"] = int(cmp.counters.abs().sum().item()) == 0
            say(f"b={b} greedy {args.steps} steps: tokens identical {first_bad is None} "
                f"(first divergent step {first_bad}), max |hidden diff| {hdiff:.3g}")
            # --- timing: positions POS - r, inactive rows (nothing advances)
            _state_for(torch, eng, b)
            st.active.zero_()
            kvb = sum(t.n_layers * 2 * t.n_kv_heads * (int(p) + 1) * t.head_dim * 2
                      for p in st.pos[:b].tolist())
            floor = (wbytes + kvb) / bw * 1e3
            row["floor_ms"] = floor
            fused_ms = _cuda_ms(torch, lambda: (eng.runner.run("lm", b),
                                                eng.runner.run("forward", b)))
            row["fused_graph_ms"] = fused_ms
            mk_ms = _cuda_ms(torch, mk.step)
            row["mk_launch_ms"] = mk_ms
            try:
                gms, g = _graph_ms(torch, mk.step)
                row["mk_graph_ms"] = gms
                del g
            except Exception as e:  # noqa: BLE001
                row["mk_graph_error"] = repr(e)[:300]
                gms = None
            best = min(x for x in (mk_ms, gms) if x is not None)
            row["mk_x_floor"] = best / floor
            row["fused_x_floor"] = fused_ms / floor
            row["fused_over_mk"] = fused_ms / best
            say(f"b={b}: floor {floor:.3f} ms | fused graph {fused_ms:.3f} ms "
                f"({fused_ms / floor:.2f}x) | megakernel launch {mk_ms:.3f} ms, graph "
                f"{gms if gms is None else round(gms, 3)} ms ({best / floor:.2f}x floor) | "
                f"fused/megakernel {fused_ms / best:.2f}")
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-2000:]
            say(f"b={b} failed: {row['error']}")
        res[f"b{b}"] = row
    print("RESULT " + json.dumps(res, default=str), flush=True)


# ---------------------------------------------------------------- parent side
def run_child(mode, args, env, timeout):
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps)]
    try:
        p = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        out = out.decode() if isinstance(out, bytes) else out
        say(f"[{mode}] TIMEOUT after {timeout:.0f} s (deadlock or slow compile); output:\n"
            + out[-3000:])
        return {"timeout": True}
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if not line.startswith("RESULT "):
            say(f"[{mode}] {line}")
    if p.returncode != 0:
        say(f"[{mode}] exit {p.returncode}; stderr tail:\n{p.stderr[-3000:]}")
    res = {"wall_s": wall, "rc": p.returncode}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    if args.child == "compile":
        return child_compile(args)
    if args.child == "bench":
        return child_bench(args)
    deadline = time.perf_counter() + args.timeout
    out = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cache = tempfile.mkdtemp(prefix="mk_triton_cache_")
    if not args.skip_compile:
        env_c = dict(env, TRITON_CACHE_DIR=cache)
        for mode in ("cold", "warm"):
            left = deadline - time.perf_counter()
            r = run_child("compile", args, env_c, max(10, min(240, left - 60)))
            out[f"compile_{mode}"] = r
            say(f"compile {mode}: " + json.dumps(r, default=str))
            if r.get("timeout") or r.get("rc"):
                break
        env = dict(env, TRITON_CACHE_DIR=cache)
    left = deadline - time.perf_counter()
    r = run_child("bench", args, env, max(10, left - 5))
    out["bench"] = r
    say("\n# bench_megakernel summary\n" + json.dumps(out, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_megakernel.json").write_text(
            json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
