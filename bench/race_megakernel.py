"""Is the megakernel's divergence from the fused backend (docs/benchmarks.md, session 3 call 4:
greedy tokens differ after 2-3 steps, "max hidden diff ~16") a race between its concurrent
programs, or near-tie token flips from a different summation order? bench_megakernel's
greedy comparison takes the max hidden diff over ALL steps, including those after the first
differing token (a different token -> a different embedding -> a hidden diff of order 10 with
no bug at all), so it cannot tell. Three checks, Moondream 2 shapes, random bf16 weights:

  1. teacher-forced: every step the megakernel starts from the fused path's pre-step state
     (the same token fed): per step, max |diff| of x / hidden / logits, whether the greedy
     tokens agree, and the fused logits' top-1 / top-2 margin where they do not (a flip with
     a margin below the logits' diff is a near tie, not a race);
  2. repeatability: the same pre-step state, R launches: deterministic mode must give the
     same bits every time; different bits between launches = a race (or an atomic order);
  3. one program (n_sm=1: the schedule in order, as the CPU tests run it) vs the full grid
     from the same state: bitwise equal unless the concurrency changes something.

Usage (H200): PYTHONPATH=. python3 bench/race_megakernel.py [--b 1,8] [--steps 16] [--reps 20]
CPU smoke (tiny fp32 model, interpreter, one program only):
              TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/race_megakernel.py --smoke
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

FIELDS = ("x", "hidden", "logits", "out", "pos", "kv")


def fields(c):
    st, fd = c.st, c.fd
    return {"x": fd.x.float().clone(), "hidden": st.hidden.float().clone(),
            "logits": fd.bufs["logits"].float().clone(), "out": st.out.clone(),
            "pos": st.pos.clone(), "kv": c.eng.kv.data.float().clone()}


def diff(a: dict, r: dict, b: int) -> dict:
    out = {}
    for f in FIELDS:
        x, y = (a[f], r[f]) if f == "kv" else (a[f][:b], r[f][:b])
        out[f] = float((x.float() - y.float()).abs().max())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemv", default="auto")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    import torch

    from bench_megakernel import Ctx
    from photon_core.megakernel.megakernel_step import MegakernelStep, reference_step
    c = Ctx(a.smoke)
    for b in (int(x) for x in a.b.split(",")):
        c.state_for(b)
        mk = MegakernelStep(c.fd, c.st, b, gemv=a.gemv)
        one = MegakernelStep(c.fd, c.st, b, n_sm=1, gemv=a.gemv) if not a.smoke else None
        print(f"== b={b}: {mk.compiled.n_programs} programs, {len(mk.compiled.instrs)} "
              f"instructions, gemv {mk.gemv}", flush=True)
        flips = 0
        for s in range(a.steps):
            s0 = c.snap()
            reference_step(c.fd, c.st, b)              # the fused path, this step
            c.sync()
            ref = fields(c)
            nxt = c.snap()
            c.restore(s0)
            mk.step()
            c.sync()
            got = fields(c)
            d = diff(got, ref, b)
            agree = bool(torch.equal(got["out"][:b, 0], ref["out"][:b, 0]))
            line = (f"step {s}: tokens agree {agree}; max |diff| " +
                    ", ".join(f"{f} {v:.3g}" for f, v in d.items() if f not in ("out", "pos")))
            if not agree:
                flips += 1
                top = ref["logits"][:b, :c.model.config.text.vocab_size].topk(2, dim=-1).values
                line += f"; fused top1-top2 margins {[round(float(m), 4) for m in top[:, 0] - top[:, 1]]}"
            print(line, flush=True)
            if s == 0:
                # 2. repeatability from this same pre-step state
                runs = []
                for _ in range(1 if a.smoke else a.reps):
                    c.restore(s0)
                    mk.step()
                    c.sync()
                    runs.append(fields(c))
                distinct = sum(any(not torch.equal(r[f], runs[0][f]) for f in FIELDS)
                               for r in runs[1:])
                print(f"  repeatability: {len(runs)} launches from one state, "
                      f"{distinct} differ from the first (a race if > 0): per field max |diff| "
                      f"{max((diff(r, runs[0], b) for r in runs[1:]), key=lambda x: x['hidden'], default={})}",
                      flush=True)
                if one is not None:       # 3. one program vs the full grid
                    c.restore(s0)
                    one.step()
                    c.sync()
                    o = fields(c)
                    print(f"  one program vs {mk.compiled.n_programs}: bitwise "
                          f"{all(torch.equal(o[f], runs[0][f]) for f in FIELDS)}, max |diff| "
                          f"{diff(o, runs[0], b)}", flush=True)
            c.restore(nxt)                               # teacher forcing: the fused state
        print(f"b={b}: {flips}/{a.steps} steps with a different token", flush=True)


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
