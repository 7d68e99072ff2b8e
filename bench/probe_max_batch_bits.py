"""Does the engine's row count (max_batch) change the bits of a batch-1 decode step? The same
batch-1 state (row 0's k/v and hidden from one seed) in engines built with max_batch 1, 4
and 8: 64 greedy steps of the fused deterministic step and of the megakernel ("on"), their
hidden states and tokens compared across engines and against each other; prints whether the
megakernel's instruction table was aligned (16-element operands: vector loads), the fused
deterministic b=1 graph time, and after one step from the same state the k/v each layer
wrote at row 0's position, fused vs megakernel (the first layer whose bits differ), and
whether the fp32 residual after the last layer is bitwise the same; over the steps, the
first step whose hidden state / token differs.

Usage: PYTHONPATH=. python3 bench/probe_max_batch_bits.py [--steps 64] [--max-batches 1,4,8]
       [--warm-steps 1,2,3] [--variant on] [--switch MODULE:NAME=VALUE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_megakernel as bm  # noqa: E402


def compare(args, c, mb: int, warm: int, mk):
    """One state (the drawn one after `warm` fused steps): the fused deterministic step and
    the megakernel (mk, built on the first call) compared; returns (mk, (fused, mega))."""
    import torch

    from photon_core.megakernel.megakernel_backend import resolve_variant
    from photon_core.megakernel.megakernel_step import MegakernelStep
    c.state_for(1)
    kv = c.eng.kv.data
    row_axis = kv.dim() - 4          # [..., rows, nkv, capacity, hd]
    g = torch.Generator(device=c.dev).manual_seed(5)
    row0 = kv.select(row_axis, 0)
    row0.copy_(torch.randn(row0.shape, generator=g, device=c.dev, dtype=row0.dtype))
    h = c.st.hidden[:1]
    h.copy_(torch.randn(h.shape, generator=g, device=c.dev, dtype=h.dtype))
    for _ in range(warm):
        c.fused_step(1, False)
    s0 = c.snap()

    def roll(step):
        c.restore(s0)
        hs, toks = [], []
        for _ in range(args.steps):
            step()
            hs.append(c.st.hidden[:1].clone())
            toks.append(c.st.out[:1, 0].clone())
        return torch.stack(hs), torch.cat(toks)
    fused = roll(lambda: c.fused_step(1, False))
    c.restore(s0)
    c.state_for(1, active=False)          # timing: nothing advances
    gr = bm._graph(torch, lambda: c.fused_step(1, False))
    print(f"max_batch {mb}, {warm} warm steps: fused deterministic b=1 graph "
          f"{bm._timed(torch, gr.replay):.4f} ms", flush=True)
    del gr
    if mk is None:
        mk = MegakernelStep(c.fd, c.st, 1, variant=resolve_variant(args.variant))
    # one step each from s0: the k/v each layer wrote at row 0's position (layer i's k/v
    # depend on layers < i and on layer i's LayerNorm + qkv GEMV only)
    p = int(s0["pos"][0])
    written, resid = [], []
    for step in (lambda: c.fused_step(1, False), mk.step):
        c.restore(s0)
        step()
        written.append(kv.select(row_axis, 0)[..., p, :].float().clone())
        resid.append(c.fd.x[:1].clone())          # the fp32 residual after the last layer
        if args.layers == 1:
            bufs = {n: t[:1].float().clone() for n, t in c.fd.bufs.items()}
            bufs["x"] = c.fd.x[:1].float().clone()
            written[-1] = (written[-1], bufs)
    if args.layers == 1:
        (written[0], b0), (written[1], b1) = written
        for n in b0:
            dd = (b0[n] - b1[n]).abs()
            cols = torch.nonzero(dd[0] > 0).flatten().tolist()
            print(f"  buffer {n} {tuple(b0[n].shape)}: max diff {dd.max().item():.3g}, "
                  f"{len(cols)} columns differ (first {cols[:6]})", flush=True)
    d = (written[0] - written[1]).abs()
    per = d.reshape(d.shape[0], -1).amax(1) if d.dim() > 1 else d
    first = next((i for i, v in enumerate(per.tolist()) if v > 0), None)
    print(f"max_batch {mb}: one step, k/v written per layer, fused vs megakernel: first "
          f"layer that differs {first}; max diff per layer "
          f"{[round(v, 4) for v in per.tolist()]}; the fp32 residual after the last layer "
          f"bitwise {torch.equal(resid[0], resid[1])} (max diff "
          f"{(resid[0] - resid[1]).abs().max().item():.3g})", flush=True)
    mega = roll(mk.step)
    eq = int((fused[1] == mega[1]).sum())
    first_h = next((i for i in range(args.steps) if not torch.equal(fused[0][i],
                                                                     mega[0][i])), None)
    first_t = next((i for i in range(args.steps) if fused[1][i] != mega[1][i]), None)
    print(f"max_batch {mb}: megakernel aligned {mk.compiled.aligned}; fused vs megakernel "
          f"tokens {eq}/{args.steps}, hidden max diff "
          f"{(fused[0].float() - mega[0].float()).abs().max().item():.3g}; the first step "
          f"whose hidden differs {first_h}, whose token differs {first_t}", flush=True)
    return mk, (fused, mega)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-batches", default="1,4,8")
    ap.add_argument("--warm-steps", default="1",
                    help="fused steps from the drawn state before the compared state; a "
                         "comma list compares each of those states in turn")
    ap.add_argument("--variant", default="on")
    ap.add_argument("--layers", type=int, default=0,
                    help="a model of this many decoder layers (0: Moondream 2's 24); with 1, "
                         "the step's buffers after one step are layer 0's: the LayerNorm "
                         "output, the qkv / fc1 GEMV output, the attention output and the "
                         "residual are compared one by one")
    ap.add_argument("--fused-fma", default="",
                    help="ROWSxK: every fused b=1 GEMV as FMA tiles of that shape (4 warps, "
                         "3 stages: the megakernel's pipe_fma@ROWSxK sums)")
    ap.add_argument("--switch", action="append", default=[],
                    help="MODULE:NAME=VALUE set before the engines are built (ab_switch's "
                         "form), e.g. photon_core.ops.decode_attention:SKIP_EMPTY_SPLITS=0")
    args = ap.parse_args()
    import torch

    from ab_switch import apply_switches
    apply_switches(args.switch)

    if args.fused_fma:
        from photon_core.ops import gemv as G
        rows, bk = (int(v) for v in args.fused_fma.split("x"))
        for key in list(G.TABLE):
            if key[3]:
                G.TABLE[key] = G.TABLE_DETERMINISTIC[key] = G.GemvConfig(rows, bk, 1, 4, 3,
                                                                         False)
    if args.layers:
        import dataclasses

        import photon_core.moondream.config as MC
        base = MC.MoondreamConfig

        def cfg():
            c = base()
            return dataclasses.replace(c, text=dataclasses.replace(c.text,
                                                                   n_layers=args.layers))
        MC.MoondreamConfig = cfg

    runs = {}
    for mb in (int(v) for v in args.max_batches.split(",")):
        c = bm.Ctx(False, mb)
        mk = None
        for warm in (int(v) for v in str(args.warm_steps).split(",")):
            mk, runs[mb] = compare(args, c, mb, warm, mk)
        del c, mk
        torch.cuda.empty_cache()
    ref = min(runs)
    for mb, (fused, mega) in runs.items():
        if mb == ref:
            continue
        for name, a, b in (("fused", runs[ref][0], fused), ("megakernel", runs[ref][1], mega)):
            print(f"{name}: max_batch {ref} vs {mb}: hidden bitwise {torch.equal(a[0], b[0])} "
                  f"(max diff {(a[0].float() - b[0].float()).abs().max().item():.3g}), tokens "
                  f"{int((a[1] == b[1]).sum())}/{args.steps}", flush=True)


if __name__ == "__main__":
    main()
