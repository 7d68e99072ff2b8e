"""Does the decode attention overlap a weight GEMV on a second stream? Moondream 2's shapes,
bf16, b rows at one position, 24 layers of their own weights and caches (nothing stays in
L2), each variant one CUDA graph of 24 layers (us per layer, median of replays):

  attn        the decode attention alone (rotary + k/v write + split attention + combine)
  fc2         the fc2 part of the residual GEMV alone (2048 x 8192, EPI_RESIDUAL)
  joined      attention, then the joined residual GEMV [proj | fc2] (2048 x 10240): the
              layer's tail as the fused step runs it today
  fork        fc2 on a side stream beside the attention, joined, then the proj GEMV (2048 x
              2048): the tail if the residual GEMV were split at its [proj | fc2] seam
  fork_main   the same with the attention on the side stream and fc2 on the caller's
  serial      attention, fc2, proj on one stream (fork's work without the overlap)

fork < joined is the gain a split residual GEMV would bring (before any cost of the split's
extra launch, counted in it here). Usage:
  PYTHONPATH=. python3 bench/probe_branch_overlap.py [--batches 1,2,4,8] [--pos 760]
      [--capacity 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
from photon_core.ops.decode_attention import AttentionScratch, decode_attention  # noqa: E402
from photon_core.ops.gemv import EPI_RESIDUAL, gemv  # noqa: E402

DIM, HEADS, HD, MLP, LAYERS = 2048, 32, 64, 8192, 24


def layer_parts(b: int, pos: int, cap: int, dev="cuda", dt=torch.bfloat16):
    """24 layers' caches and residual weights (joined and split), the step's buffers."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02
    layers = []
    for _ in range(LAYERS):
        kc, vc = rnd(b, HEADS, cap, HD), rnd(b, HEADS, cap, HD)
        w2 = rnd(DIM, DIM + MLP)
        layers.append({"kc": kc, "vc": vc, "w2": w2, "proj": w2[:, :DIM].contiguous(),
                       "fc2": w2[:, DIM:].contiguous(), "bias": rnd(DIM).float()})
    half = HD // 4                                 # Phi's partial rotary: 32 of 64 channels
    ang = torch.arange(cap, device=dev, dtype=torch.float32)[:, None] * \
        torch.rand(half, device=dev, generator=g)[None, :]
    bufs = {"qkv": rnd(b, 3 * DIM), "pos": torch.full((b,), pos, device=dev, dtype=torch.long),
            "cos": ang.cos(), "sin": ang.sin(), "att": torch.empty(b, DIM, device=dev, dtype=dt),
            "h": rnd(b, DIM + MLP), "y": torch.zeros(b, DIM, device=dev),
            "scratch": AttentionScratch(b, HEADS, HD, cap, 128, dev, min_chunk=64)}
    return layers, bufs


def variants(bufs):
    side = torch.cuda.Stream()
    s = bufs

    def attn(L):
        decode_attention(s["qkv"], s["pos"], s["cos"], s["sin"], L["kc"], L["vc"], s["att"],
                         s["scratch"], HEADS, HEADS, HD)

    def fc2(L):
        gemv(s["h"][:, DIM:], L["fc2"], L["bias"], s["y"], EPI_RESIDUAL)

    def proj(L):
        gemv(s["att"], L["proj"], None, s["y"], EPI_RESIDUAL)

    def joined(L):
        attn(L)
        gemv(s["h"], L["w2"], L["bias"], s["y"], EPI_RESIDUAL)

    def fork(L, attn_side=False):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (attn if attn_side else fc2)(L)
        (fc2 if attn_side else attn)(L)
        torch.cuda.current_stream().wait_stream(side)
        proj(L)

    def serial(L):
        attn(L)
        fc2(L)
        proj(L)
    return {"attn": attn, "fc2": fc2, "joined": joined, "fork": fork,
            "fork_main": lambda L: fork(L, True), "serial": serial}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--pos", type=int, default=760)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=1024,
                    help="positions per cache row (FastEngine's default on the GPU: 1024)")
    args = ap.parse_args()
    for b in (int(v) for v in args.batches.split(",")):
        layers, bufs = layer_parts(b, args.pos, args.capacity)
        fns = variants(bufs)
        res = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                ms = graph_ms(lambda: [f(L) for L in layers], calls=1, replays=15)
                res[name].append(ms * 1e3 / LAYERS)
        print(f"b={b} pos={args.pos}: us per layer (rounds: " + ", ".join(
            f"{k} {' / '.join(f'{v:.2f}' for v in vs)}" for k, vs in res.items()) + ")")
        j, f = min(res["joined"]), min(res["fork"])
        print(f"  fork vs joined: {j / f:.3f}x ({f:.2f} vs {j:.2f} us/layer; x24 = "
              f"{(j - f) * LAYERS:.0f} us per step)")
        del layers, bufs, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
