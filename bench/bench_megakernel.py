"""Decode step on the GPU it runs on (written for the H200), Moondream 2 shapes, random bf16
weights, deterministic mode, all in one run against same-run baselines: the bandwidth floor,
the fused backend's CUDA graph, the same with programmatic dependent launch
(EngineOptions.pdl), and the megakernel (photon_core/megakernel) at batch 1 and 8; its
compile time (cold / cached); greedy agreement over 64 steps. Every GPU phase runs in a child
process under a timeout (a watchdog: a deadlocked persistent kernel cannot hang the run); the
parent prints one table at the end.

Phases (child processes):
  compile   cold: a fresh TRITON_CACHE_DIR, build + first launch of the megakernel (b=1,
            default variant) = its compile; warm: the same in a new process = the cached start
  fused     copy bandwidth -> floor = (decoder weights incl. lm head + k/v at positions
            POS - r) / bandwidth;
            per batch (--batches, default 1 and 8): step = forward (feedback, decoder, row advance) + lm head pick,
              fused graph (pdl off / on; deterministic mode and the default split-K mode),
              each the median of 5 x (20 back-to-back replays between two events) / 20; greedy: 64 steps from the same state, text rows:
              fused (pdl off) = reference, fused pdl on must give the same bits
  mk        (its own process: a hang cannot lose the numbers above) the megakernel graph
            (feed + one launch), timed the same way; greedy vs the fused reference: tokens
            equal per step (first divergent step), max |hidden diff|, bitwise;
            megakernel variants (num_warps:unroll:gemv, --variants1 / --variants8), the
              first of each first; variants left when the child's time budget is spent are
              skipped (reported), so the table always prints.

Usage: PYTHONPATH=. python3 bench/bench_megakernel.py [--timeout 420] [--steps 64]
           [--variants1 V,V,...] [--variants8 V,...]   (V: megakernel_step.Variant strings)
           [--batches 1,8]   (b=1 runs --variants1, every other b --variants8)
           [--skip-compile] [--reserve 90]
       PYTHONPATH=. TRITON_INTERPRET=1 python3 bench/bench_megakernel.py --smoke
           (CPU: the same code paths on the tiny fp32 model, no graphs, no timing value)
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
LINES: list[str] = []
# the sweep (session 4): the pipelined GEMV stream (FMA / tensor cores, tile sizes, stages),
# the b=1 FMA stream, fewer warps (its L2 prefetch, kv2 and greedy-placement builds were
# removed in session 39: docs/dropped_experiments.md)
VARIANTS1 = ",".join(("pipe_fma@16x512/w8/s4", "pipe_same/w4/s4", "fma/w8/s3/u4",
                      "pipe@16x512/w4/s4"))
VARIANTS8 = ",".join(("pipe@16x512/w4/s4", "pipe_same/w4/s4", "small/w8/s3/u2"))


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


# ---------------------------------------------------------------- child side
class Ctx:
    """The engine under test: a FastEngine (deterministic, no warm-up graphs) on CUDA, or the
    tiny fp32 model on the CPU (--smoke)."""

    def __init__(self, smoke: bool, b_max: int = 8):
        import torch

        from photon_core.fast import FastEngine
        self.torch, self.smoke = torch, smoke
        torch.manual_seed(0)
        if smoke:
            from photon_core.moondream.model import build_random_model
            from photon_core.moondream.test_model import tiny_config
            self.model = build_random_model(tiny_config(fast=True), device="cpu",
                                            dtype="fp32", seed=0)
            self.kv_cap, self.pos0 = 64, 50
        else:
            from photon_core.moondream.config import MoondreamConfig
            from photon_core.moondream.model import build_random_model
            self.model = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16",
                                            seed=0)
            self.kv_cap, self.pos0 = KV, POS
        self.eng = FastEngine(self.model, max_batch=b_max, kv_capacity=self.kv_cap,
                              deterministic=True, fused="on", megakernel="off",
                              graphed_prefill=False,
                              graphed_encoder=False, detok_thread=False, warmup=False)
        self.st = self.eng.state
        self.fd = self.st.fused
        assert self.fd is not None and self.fd.deterministic
        self.dev = self.st.hidden.device

    def use_attn_chunk(self, chunk: int) -> None:
        """Keys per attention split (the fused backend's scratch, which the megakernel's
        lowering takes its split from); 0: the backend's own (fused_backend.ATTN_CHUNK)."""
        if chunk:
            from photon_core.ops.decode_attention import ROWS_CHUNK, AttentionScratch
            a = self.fd.program.attention
            self.fd.scratch = AttentionScratch(self.fd.x.shape[0], a.n_heads, a.head_dim,
                                               self.kv_cap, chunk, self.dev,
                                               min_chunk=ROWS_CHUNK)

    def sync(self):
        if not self.smoke:
            self.torch.cuda.synchronize()

    def state_for(self, b: int, active: bool = True, seed: int = 1):
        """rows [0, b): text phase, first pick done, positions pos0 - r, random k/v."""
        torch, st = self.torch, self.st
        g = torch.Generator(device=self.dev).manual_seed(seed)
        self.eng.kv.data.normal_(generator=g)
        st.hidden.normal_(generator=g)
        st.pos.zero_()
        st.pos[:b] = torch.arange(self.pos0, self.pos0 - b, -1, device=self.dev)
        st.phase.zero_()
        st.kind.zero_()
        st.first.zero_()
        st.active.zero_()
        st.active[:b] = active
        st.out.zero_()
        self.fd.x.zero_()

    def snap(self):
        st = self.st
        s = {n: getattr(st, n).clone() for n in ("hidden", "pos", "phase", "first", "active",
                                                 "out")}
        s["kv"], s["x"] = self.eng.kv.data.clone(), self.fd.x.clone()
        return s

    def restore(self, s):
        st = self.st
        for n in ("hidden", "pos", "phase", "first", "active", "out"):
            getattr(st, n).copy_(s[n])
        self.eng.kv.data.copy_(s["kv"])
        self.fd.x.copy_(s["x"])

    # one decode step = the forward (feedback of out, decoder, row advance) + the lm head's
    # greedy pick (the runtime launches the pick first, then the forward: the same work);
    # in this order it is what one megakernel step (feed + launch) computes
    def fused_step(self, b: int, pdl: bool):
        from photon_core.fast import decode_step as ds
        self.fd.pdl = pdl
        ds.forward(self.st, b)
        ds.lm_greedy(self.st, b)

    def mk(self, b: int, variant: str = "auto"):
        """A MegakernelStep for a Variant string (or a bare GEMV choice)."""
        from photon_core.megakernel.megakernel_step import MegakernelStep
        return MegakernelStep(self.fd, self.st, b, variant=variant)


def _timed(torch, fn, reps=20, rounds=5):
    """median over rounds of (reps back-to-back calls between two events) / reps, in ms."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        out.append(a.elapsed_time(e) / reps)
    return statistics.median(out)


def _graph(torch, fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def child_compile(args):
    t0 = time.perf_counter()
    c = Ctx(args.smoke, 1)
    v = _variants(args)[0]
    t1 = time.perf_counter()
    mk = c.mk(1, v)
    t2 = time.perf_counter()
    c.st.active.zero_()
    mk.run_kernel()
    c.sync()
    t3 = time.perf_counter()
    cc = mk.compiled
    print("RESULT " + json.dumps({
        "setup_s": round(t1 - t0, 2), "schedule_s": round(t2 - t1, 3),
        "first_launch_s": round(t3 - t2, 3), "instructions": len(cc.instrs),
        "programs": cc.n_programs, "aligned": cc.aligned,
        "est_makespan_us": round(cc.makespan_us, 1)}), flush=True)


def _variants(args, b: int = 1) -> list[str]:
    """--variants1 / --variants8: comma-separated megakernel_step.Variant strings
    ("gemv[@RxK]/w8/s4/u2/noalign")."""
    from photon_core.megakernel.megakernel_step import Variant
    vs = [str(Variant.parse(v)) for v in
          (args.variants1 if b == 1 else args.variants8).split(",")]
    # each variant is built and measured once (its results are keyed by its string): a
    # repeat would only print the first measurement again
    return list(dict.fromkeys(vs))


def _batches(args) -> tuple[int, ...]:
    """--batches: the batch sizes measured (1..8); b=1 takes --variants1, the others
    --variants8."""
    bs = tuple(int(x) for x in args.batches.split(","))
    assert bs and all(1 <= x <= 8 for x in bs), bs
    return bs


def _greedy(c, b, steps, step_fn):
    """tokens [steps][b] and hidden states of `steps` steps from the current state."""
    toks, hid = [], []
    for _ in range(steps):
        step_fn()
        toks.append(c.st.out[:b, 0].clone())
        hid.append(c.st.hidden[:b].clone())
    c.sync()
    return toks, hid


def _agreement(ref, got):
    (rt, rh), (gt, gh) = ref, got
    first_bad = next((k for k, (a, b) in enumerate(zip(rt, gt))
                      if not bool((a == b).all())), None)
    same = sum(int((a == b).sum()) for a, b in zip(rt, gt))
    hdiff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(rh, gh))
    bitwise = all(bool((a == b).all()) for a, b in zip(rh, gh))
    return {"first_divergent_step": first_bad, "tokens_equal": same,
            "tokens_total": sum(int(a.numel()) for a in rt), "max_hidden_diff": hdiff,
            "hidden_bitwise": bitwise}


def _fused_baselines(c, b, args, row, wbytes, bw, pdl_check=True):
    """Greedy reference (fused, pdl off), PDL agreement, floor and fused graph timings at b;
    returns (state s0, reference)."""
    torch = c.torch
    c.state_for(b)
    c.fused_step(b, False)          # one step so that every row has a token to feed
    s0 = c.snap()
    ref = _greedy(c, b, args.steps, lambda: c.fused_step(b, False))
    c.restore(s0)
    if not pdl_check:
        return s0, ref
    row["pdl_vs_fused"] = _agreement(ref, _greedy(c, b, args.steps,
                                                  lambda: c.fused_step(b, True)))
    say(f"b={b} greedy {args.steps} steps, fused+PDL vs fused: {row['pdl_vs_fused']}")
    c.fd.pdl = False
    if args.smoke:
        return s0, ref
    t = c.model.config.text
    c.state_for(b, active=False)    # inactive rows: nothing advances, every replay the same
    kvb = sum(t.n_layers * 2 * t.n_kv_heads * (int(p) + 1) * t.head_dim * 2
              for p in c.st.pos[:b].tolist())
    floor = (wbytes + kvb) / bw * 1e3
    row["floor_ms"] = floor
    # deterministic (no split-K: what the megakernel is diffed against) and the default
    # (split-K residual GEMV, fp32 atomics), each without and with PDL
    for det in (True, False):
        c.fd.deterministic = det
        for pdl in (False, True):
            key = "fused" + ("" if det else "_nd") + ("_pdl" if pdl else "") + "_ms"
            try:
                g = _graph(torch, lambda: c.fused_step(b, pdl))
                row[key] = _timed(torch, g.replay)
                del g
                say(f"b={b} {key} {row[key]:.4f} ({row[key] / floor:.2f}x floor {floor:.4f})")
            except Exception:  # noqa: BLE001
                row[key + "_error"] = traceback.format_exc()[-1500:]
                say(f"b={b} {key} failed: {row[key + '_error']}")
    c.fd.deterministic = True
    c.fd.pdl = False
    return s0, ref


def _megakernel_variant(c, b, vs, args, row, mks, s0, ref):
    """One variant: greedy agreement with the fused reference over args.steps steps, then
    (GPU) graph replay time, launch time, the same table with every wait dropped (the
    instructions' own time: no dependency stalls; values garbage), only its GEMVs without
    waits, registers / spills."""
    import sys as _sys
    _sys.path.insert(0, str(ROOT / "bench"))
    from diag_megakernel import subset
    from photon_core.megakernel.instructions import (OP_ATTN, OP_GEMV_LM, OP_GEMV_W1,
                                                     OP_GEMV_W2)
    from photon_core.megakernel.kernel import launch
    from photon_core.megakernel.megakernel_step import MegakernelStep, Variant
    torch = c.torch
    v = Variant.parse(vs)
    name = f"mk[{vs}]"
    # one compiled table per GEMV shapes, attention split and placement
    gk = (v.gemv + (f"/a{v.attn_per}" if v.attn_per else "")
          + (f"/p{v.per_sm}" if v.per_sm != 1 else "") + ("/fill" if v.fill else ""))
    if gk not in mks:
        mks[gk] = MegakernelStep(c.fd, c.st, b, variant=v)
        cm = mks[gk].compiled
        row[f"mk_{gk}_instructions"] = len(cm.instrs)
        row[f"mk_{gk}_programs"] = cm.n_programs
        row[f"mk_{gk}_aligned"] = cm.aligned
        row[f"mk_{gk}_est_makespan_us"] = round(cm.makespan_us, 1)
        qs = cm.queues()
        row[f"mk_{gk}_max_instr_per_program"] = max(len(q) for q in qs)
        row[f"mk_{gk}_max_attn_per_program"] = max(sum(i.op == OP_ATTN for i in q)
                                                    for q in qs)
        say(f"b={b} {gk}: {len(cm.instrs)} instructions on {cm.n_programs} programs, at most "
            f"{row[f'mk_{gk}_max_instr_per_program']} per program, of them attention at most "
            f"{row[f'mk_{gk}_max_attn_per_program']}")
        row[f"mk_{gk}_gemv_cfg"] = str(mks[gk].low.gemv_cfg)
    mk = mks[gk]
    c.fd.pdl = False
    kw = dict(num_warps=v.warps, unroll=v.unroll or mk.unroll, **v.launch_kw())

    def mk_step():
        mk.feed()
        launch(mk.compiled, mk.low, **kw)
    c.restore(s0)
    t0 = time.perf_counter()
    mk_step()
    c.sync()
    row[f"{name}_first_launch_s"] = round(time.perf_counter() - t0, 2)
    c.restore(s0)
    row[f"{name}_greedy"] = _agreement(ref, _greedy(c, b, args.steps, mk_step))
    row[f"{name}_counters_reset"] = int(mk.compiled.counters.abs().sum()) == 0
    say(f"b={b} greedy {args.steps} steps, megakernel {name} vs fused: "
        f"{row[f'{name}_greedy']} (first launch {row[f'{name}_first_launch_s']} s, "
        f"aligned {mk.compiled.aligned})")
    if args.smoke:
        return
    c.state_for(b, active=False)
    row[f"{name}_launch_ms"] = _timed(torch, mk_step)
    try:
        g = _graph(torch, mk_step)
        row[f"{name}_graph_ms"] = _timed(torch, g.replay)
        del g
    except Exception:  # noqa: BLE001
        row[f"{name}_graph_error"] = traceback.format_exc()[-1500:]
        say(f"b={b} {name} graph failed: {row[f'{name}_graph_error']}")
    for key, keep in (("nowait", lambda i: True),
                      ("gemv_nowait", lambda i: i.op in (OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM)),
                      ("attn_nowait", lambda i: i.op == OP_ATTN)):
        try:
            sub = subset(mk.compiled, keep)
            row[f"{name}_{key}_ms"] = _timed(torch, lambda: launch(sub, mk.low, **kw))
        except Exception:  # noqa: BLE001
            row[f"{name}_{key}_error"] = traceback.format_exc()[-800:]
    fl = row.get("floor_ms")
    say(f"b={b} {name}: graph {row.get(f'{name}_graph_ms')} ms, launch "
        f"{row[f'{name}_launch_ms']:.4f} ms, no waits {row.get(f'{name}_nowait_ms')} ms, "
        f"GEMVs only (no waits) {row.get(f'{name}_gemv_nowait_ms')} ms, attention only "
        f"{row.get(f'{name}_attn_nowait_ms')} ms, floor {fl}")
    try:
        kern = launch(mk.compiled, mk.low, **kw)
        row[f"{name}_regs_spills_shared"] = (getattr(kern, "n_regs", None),
                                             getattr(kern, "n_spills", None),
                                             getattr(getattr(kern, "metadata", None),
                                                     "shared", None))
    except Exception:  # noqa: BLE001
        pass


def _bandwidth_and_bytes(c, args):
    torch = c.torch
    if not args.smoke:
        n = 2 ** 30
        a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(a)
        ms = _timed(torch, lambda: z.copy_(a), reps=5, rounds=5)
        bw = 2 * a.numel() * 2 / (ms * 1e-3)
        del a, z
        torch.cuda.empty_cache()
    else:
        bw = 1e12
    wbytes = sum(t.numel() * t.element_size() for nm, t in c.model.weights.items()
                 if nm.startswith("text.") and nm != "text.wte")
    return bw, wbytes


def child_fused(args):
    """floor, fused graph, fused+PDL graph, PDL greedy agreement at b=1 and b=8."""
    c = Ctx(args.smoke, 8)
    c.use_attn_chunk(args.attn_chunk)
    bw, wbytes = _bandwidth_and_bytes(c, args)
    gpu = c.torch.cuda.get_device_name() if c.torch.cuda.is_available() else "cpu"
    res = {"gpu": gpu, "copy_TBps": bw / 1e12, "decoder_GB": wbytes / 1e9}
    say(f"{gpu}: copy bandwidth {bw / 1e12:.2f} TB/s; decoder weights + lm head "
        f"{wbytes / 1e9:.2f} GB")
    for b in _batches(args):
        row = res.setdefault(f"b{b}", {})
        try:
            _fused_baselines(c, b, args, row, wbytes, bw)
        except Exception:  # noqa: BLE001
            row["fused_error"] = traceback.format_exc()[-2000:]
            say(f"b={b} fused failed: {row['fused_error']}")
    print("RESULT " + json.dumps(res, default=str), flush=True)


def child_mk(args):
    """The megakernel variants: greedy agreement with the fused backend (pdl off), timing."""
    t_start = time.perf_counter()
    c = Ctx(args.smoke, 8)
    c.use_attn_chunk(args.attn_chunk)
    res = {"variants1": args.variants1, "variants8": args.variants8}
    vs_of = {b: _variants(args, b) for b in _batches(args)}
    # jobs in priority order: the first variant of every batch, then the others
    jobs = [(b, v[0]) for b, v in vs_of.items()] + [(b, x) for b, v in vs_of.items()
                                                     for x in v[1:]]
    base, mks = {}, {b: {} for b in vs_of}

    for b, vs in jobs:
        row = res.setdefault(f"b{b}", {})
        name = f"mk[{vs}]"
        if time.perf_counter() - t_start > args.budget:
            row[f"{name}_error"] = "skipped: over the child's time budget"
            say(f"b={b} {name} skipped (time budget)")
            continue
        try:
            if b not in base:
                base[b] = _fused_baselines(c, b, args, {}, 0, 1.0, pdl_check=False)
            _megakernel_variant(c, b, vs, args, row, mks[b], *base[b])
        except Exception:  # noqa: BLE001
            row[f"{name}_error"] = traceback.format_exc()[-2000:]
            say(f"b={b} {name} failed: {row[f'{name}_error']}")
        # what is measured so far, should a later variant hang (the parent reads these)
        print("PARTIAL " + json.dumps({f"b{b}": {k: v for k, v in row.items()
                                                 if k.startswith(name)}}, default=str),
              flush=True)
    print("RESULT " + json.dumps(res, default=str), flush=True)


# ---------------------------------------------------------------- parent side
def run_child(mode, args, env, timeout):
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
           "--variants1", args.variants1, "--variants8", args.variants8,
           "--batches", args.batches, "--attn-chunk", str(args.attn_chunk),
           "--budget", str(max(10.0, timeout - args.reserve))] + (
        ["--smoke"] if args.smoke else [])
    try:
        p = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        out = out.decode() if isinstance(out, bytes) else out
        say(f"[{mode}] TIMEOUT after {timeout:.0f} s (deadlock or slow compile); output:\n"
            + "\n".join(ln for ln in out.splitlines()[-40:]
                         if not ln.startswith(("PARTIAL ", "RESULT "))))
        res = {"timeout": True}
        for line in out.splitlines():       # the variants measured before the hang
            if line.startswith("PARTIAL "):
                for bb, r in json.loads(line[8:]).items():
                    res.setdefault(bb, {}).update(r)
        return res
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if not line.startswith(("RESULT ", "PARTIAL ")):
            say(f"[{mode}] {line}")
    if p.returncode != 0:
        say(f"[{mode}] exit {p.returncode}; stderr tail:\n{p.stderr[-3000:]}")
    res = {"wall_s": round(wall, 1), "rc": p.returncode}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    return res


def _f(v, nd=3):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table(out, args) -> list[str]:
    b = out.get("bench", {})

    def g(a):
        if not a:
            return "-"
        return (f"{a['tokens_equal']}/{a['tokens_total']} (first diff "
                f"{a['first_divergent_step']}, hidden max diff {a['max_hidden_diff']:.3g}, "
                f"bitwise {a['hidden_bitwise']})")
    lines = []
    for bb in _batches(args):
        r = b.get(f"b{bb}", {})
        fl, fused = r.get("floor_ms"), r.get("fused_ms")

        def x(v):
            return "-" if v is None or not fl else f"{v:.3f} ({v / fl:.2f}x)"
        lines.append(f"b={bb}: floor {_f(fl)} ms; fused graph (deterministic) {x(fused)}; "
                     f"+PDL {x(r.get('fused_pdl_ms'))}; default split-K {x(r.get('fused_nd_ms'))}"
                     f"; greedy PDL vs fused {g(r.get('pdl_vs_fused'))}")
    lines += ["", "| b | variant | graph ms (x floor) | fused / mk | no waits ms | GEMVs only, "
              "no waits ms | attention only ms | regs, spills, smem | greedy vs fused "
              "(tokens equal) |", "|---|---|---|---|---|---|---|---|---|"]
    for bb in _batches(args):
        r = b.get(f"b{bb}", {})
        fl, fused = r.get("floor_ms"), r.get("fused_ms")
        for vs in _variants(args, bb):
            n = f"mk[{vs}]"
            if f"{n}_error" in r and f"{n}_greedy" not in r:
                lines.append(f"| {bb} | {vs} | error: "
                             f"{r[f'{n}_error'].strip().splitlines()[-1][:120]} | | | | | | |")
                continue
            gm = r.get(f"{n}_graph_ms")
            xf = "-" if gm is None or not fl else f"{gm:.3f} ({gm / fl:.2f}x)"
            sp = "-" if not (fused and gm) else f"{fused / gm:.2f}"
            lines.append(f"| {bb} | {vs} | {xf} | {sp} | {_f(r.get(f'{n}_nowait_ms'))} | "
                         f"{_f(r.get(f'{n}_gemv_nowait_ms'))} | "
                         f"{_f(r.get(f'{n}_attn_nowait_ms'))} | "
                         f"{r.get(f'{n}_regs_spills_shared', '-')} | "
                         f"{g(r.get(f'{n}_greedy'))} |")
    lines.append("")
    for bb in _batches(args):
        r = b.get(f"b{bb}", {})
        for k, v in sorted(r.items()):
            if k.startswith("mk_") and k.endswith(("_aligned", "_instructions")):
                lines.append(f"- b={bb} {k}: {v}")
    cc, cw = out.get("compile_cold", {}), out.get("compile_warm", {})
    lines.append(f"- megakernel compile (b=1, first variant): cold first launch "
                 f"{_f(cc.get('first_launch_s'), 2)} s (process {_f(cc.get('wall_s'), 1)} s), "
                 f"cached {_f(cw.get('first_launch_s'), 3)} s; schedule "
                 f"{_f(cc.get('schedule_s'), 3)} s; {cc.get('instructions')} instructions on "
                 f"{cc.get('programs')} programs")
    lines.append(f"- copy bandwidth {_f(b.get('copy_TBps'), 2)} TB/s, decoder + lm head "
                 f"{_f(b.get('decoder_GB'), 2)} GB, KV capacity {KV}, positions {POS} - r")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--variants1", default=VARIANTS1,
                    help="megakernel_step.Variant strings at b=1, comma-separated (the first "
                         "also for the compile-time phase)")
    ap.add_argument("--variants8", default=VARIANTS8, help="the same at every b > 1")
    ap.add_argument("--batches", default="1,8", help="batch sizes measured (1..8)")
    ap.add_argument("--budget", type=float, default=1e9,
                    help="(child) seconds after which further megakernel variants are skipped")
    ap.add_argument("--reserve", type=float, default=90,
                    help="seconds of the megakernel child's time kept for its last variant "
                         "(no variant starts later than its timeout - reserve; H200: ~9 s "
                         "per variant)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--attn-chunk", type=int, default=0,
                    help="keys per attention split, fused baselines and megakernel alike "
                         "(0: the fused backend's ATTN_CHUNK)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, no timing")
    args = ap.parse_args()
    if args.child == "compile":
        return child_compile(args)
    if args.child == "fused":
        return child_fused(args)
    if args.child == "mk":
        return child_mk(args)
    if args.smoke:
        args.steps = min(args.steps, 4)
    deadline = time.perf_counter() + args.timeout
    out = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if not args.smoke:
        env.pop("TRITON_INTERPRET", None)
    cache = tempfile.mkdtemp(prefix="mk_triton_cache_")
    if not args.skip_compile:
        env_c = dict(env, TRITON_CACHE_DIR=cache)
        for mode in ("cold", "warm"):
            left = deadline - time.perf_counter()
            r = run_child("compile", args, env_c, max(10, min(150, left - 120)))
            out[f"compile_{mode}"] = r
            say(f"compile {mode}: " + json.dumps(r, default=str))
            if r.get("timeout") or r.get("rc"):
                break
        env = dict(env, TRITON_CACHE_DIR=cache)
    left = deadline - time.perf_counter()
    fused = run_child("fused", args, env, max(10, min(150, left - 60)))
    left = deadline - time.perf_counter()
    mk = run_child("mk", args, env, max(10, left - 5))
    bench = {k: v for k, v in fused.items() if not k.startswith("b")}
    for bb in (f"b{x}" for x in _batches(args)):
        bench[bb] = dict(fused.get(bb, {}), **mk.get(bb, {}))
    bench["mk_child"] = {k: v for k, v in mk.items() if not k.startswith("b")}
    out["bench"] = bench
    say(f"\n# bench_megakernel ({bench.get('gpu', 'GPU not known')}, deterministic mode, "
        "step = forward + lm pick)")
    for line in table(out, args):
        say(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_megakernel.json").write_text(
            json.dumps(out, indent=1, default=str))
        Path(os.environ["OUT"], "bench_megakernel.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
