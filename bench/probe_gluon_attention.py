"""The Gluon vision attention (ops/vision_attention_gluon.py: head 72 as 64 + 16 columns,
TMA, asynchronous wgmma) against SDPA (cuDNN) on the H200, config by config, then the
9-crop encode graph with the fastest right config against SDPA.

Usage (H200): PYTHONPATH=. python3 bench/probe_gluon_attention.py [--configs 64x64x2,64x128x2x1]
    (BMxBNxSTAGES[xPIPE[xWS]]; BM 64: one warpgroup, 128: two; PIPE 1: the FA-3 pipeline;
    WS "wg": a partition per warpgroup, e.g. 128x64x2x0xwg, the op's default)
A config whose output is wrong (rel. diff >= 0.01) is diagnosed at once (`diagnose`: one
crop, one key block, columns 64-71 zeroed; the error by columns / heads / row blocks /
crops), so one device call says where it goes wrong.
--sweep-crops 2,4,6,11 then times the first config and SDPA at those crop counts (the
grid's last partial wave: session 45); --hd 80 another head size.
Writes $OUT/probe_gluon_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core.ops.vision_attention_gluon import (parse_config,  # noqa: E402
                                                    vision_attention_gluon)


def diagnose(config: str, heads: int = 16, hd: int = 72, t: int = 729, attn=None,
             device: str = "cuda") -> dict:
    """Where a wrong config goes wrong (one device call should say more than "wrong"): the
    max error over |ref| max of the kernel on inputs that take one piece away each -
    one crop (no crop offsets), one key block of BN keys (no online softmax / pipeline
    phases), head columns 64-71 zero in q, k and v (the 16-column boxes carry nothing) -
    and, on the 9-crop input, the error split by output columns (0-63 / 64-71), by heads,
    by query-row block, by crop. attn(qkv, heads, config tuple): default the op's kernel."""
    from photon_core.ops.vision_attention import vision_attention_reference
    cfg = parse_config(config)
    bm, bn = cfg[:2]
    attn = attn or vision_attention_gluon
    g = torch.Generator(device).manual_seed(11)

    def err(qkv):
        ref = vision_attention_reference(qkv.float(), heads)
        got = attn(qkv, heads, cfg).float()
        return got, ref, ref.abs().max().item()

    def rel(qkv):
        got, ref, sc = err(qkv)
        return round((got - ref).abs().max().item() / sc, 5)

    def rnd(n, tt):
        return torch.randn(n, tt, 3 * heads * hd, device=device, dtype=torch.bfloat16,
                           generator=g) * 2
    out = {"one_crop": rel(rnd(1, t)), "one_block": rel(rnd(1, bn)),
           "one_query_block_one_key_block": rel(rnd(1, min(bm, bn)))}
    z = rnd(9, t).view(9, t, 3, heads, hd)
    z[..., 64:] = 0
    out["cols_64_71_zero"] = rel(z.view(9, t, 3 * heads * hd))
    got, ref, sc = err(rnd(9, t))
    d = ((got - ref).abs() / sc).view(9, t, heads, hd)
    out["by_columns"] = {"0-63": round(d[..., :64].max().item(), 5),
                         "64-71": round(d[..., 64:].max().item(), 5)}
    out["by_head"] = [round(x, 4) for x in d.amax(dim=(0, 1, 3)).tolist()]
    out["by_query_block"] = [round(c.max().item(), 4) for c in d.amax(dim=(0, 2, 3)).split(bm)]
    out["by_crop"] = [round(x, 4) for x in d.amax(dim=(1, 2, 3)).tolist()]
    return out


def main():
    from bench.bench_timing import graph_ms
    from bench.out_dir import write_json
    from photon_core.ops.vision_attention import vision_attention_reference
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64x64x2,64x128x2,64x64x3,64x32x3")
    ap.add_argument("--crops", type=int, default=9)
    ap.add_argument("--hd", type=int, default=72, help="head dim (72: Moondream 2's; or 80)")
    ap.add_argument("--sweep-crops", default="",
                    help="then the first config (and SDPA) at these crop counts, e.g. 2,4,6,11 "
                         "(programs per wave: the tail's cost)")
    ap.add_argument("--encode-ab", action="store_true",
                    help="then the encode graph with SDPA vs the fastest config that is "
                         "right (rel. diff < 0.01) and faster than SDPA, ABBA x 2")
    args = ap.parse_args()
    heads, t, hd, layers = 16, 729, args.hd, 27
    g = torch.Generator("cuda").manual_seed(9)
    qkv = torch.randn(args.crops, t, 3 * heads * hd, device="cuda", dtype=torch.bfloat16,
                      generator=g) * 2
    ref32 = vision_attention_reference(qkv.float(), heads)
    scale = ref32.abs().max().item()
    flop = 4 * args.crops * heads * t * t * hd * layers
    out = {"gpu": torch.cuda.get_device_name(), "rows": {}}

    def row(fn):
        r = {"rel_diff_vs_fp32": round((fn().float() - ref32).abs().max().item() / scale, 5)}
        ms = graph_ms(fn, calls=layers) * layers
        r.update(ms_per_encode=round(ms, 4), tflops=round(flop / ms / 1e9, 1))
        return r
    out["rows"]["sdpa"] = row(lambda: vision_attention_reference(qkv, heads))
    print("sdpa", out["rows"]["sdpa"], flush=True)
    for c in args.configs.split(","):
        try:
            r = row(lambda c=c: vision_attention_gluon(qkv, heads, parse_config(c)))
            r["vs_sdpa"] = round(out["rows"]["sdpa"]["ms_per_encode"] / r["ms_per_encode"], 3)
        except Exception as e:  # noqa: BLE001
            r = {"error": repr(e)[:400]}
        if r.get("rel_diff_vs_fp32", 0) >= 0.01:
            try:
                r["diagnose"] = diagnose(c, hd=hd)
            except Exception as e:  # noqa: BLE001
                r["diagnose"] = {"error": repr(e)[:400]}
        out["rows"][c] = r
        print(c, r, flush=True)
        if "illegal" in repr(r):
            break
    write_json("probe_gluon_attention.json", out)
    if args.sweep_crops:
        out["sweep_crops"] = sweep_crops(args.configs.split(",")[0],
                                         [int(c) for c in args.sweep_crops.split(",")], hd)
        write_json("probe_gluon_attention.json", out)
    ok = {c: r for c, r in out["rows"].items() if c != "sdpa" and "ms_per_encode" in r
          and r["rel_diff_vs_fp32"] < 0.01 and r["vs_sdpa"] > 1.0}
    if args.encode_ab and ok:
        best = min(ok, key=lambda c: ok[c]["ms_per_encode"])
        out["encode_ab"] = encode_ab(best)
        write_json("probe_gluon_attention.json", out)


def sweep_crops(config: str, crops: list[int], hd: int = 72, heads: int = 16, t: int = 729,
                layers: int = 27) -> dict:
    """ms per 27 calls of SDPA and of the config at each crop count (the grid's programs
    grow by heads x cdiv(t, BM) per crop: where the last wave's share of the time shows)."""
    from bench.bench_timing import graph_ms
    from photon_core.ops.vision_attention import vision_attention_reference
    cfg = parse_config(config)
    rows = {}
    for n in crops:
        qkv = torch.randn(n, t, 3 * heads * hd, device="cuda", dtype=torch.bfloat16)
        r = {"sdpa_ms": round(graph_ms(lambda: vision_attention_reference(qkv, heads),
                                       calls=layers) * layers, 4),
             "gluon_ms": round(graph_ms(lambda: vision_attention_gluon(qkv, heads, cfg),
                                        calls=layers) * layers, 4)}
        r["gluon_ms_per_crop"] = round(r["gluon_ms"] / n, 4)
        rows[n] = r
        print(f"crops {n} {config}", r, flush=True)
    return rows


def encode_ab(config: str) -> dict:
    """The runtime's 9-crop encode graph with SDPA vs this config's kernel
    (vision_fused.ATTENTION = "gluon:<config>"; ab_encode.moondream_encode_rounds)."""
    from bench.ab_encode import moondream_encode_rounds
    from photon_core.models.moondream2 import vision_fused
    parse_config(config)                    # (a bad config fails here, not in the A/B)
    before = vision_fused.ATTENTION

    def switch(label):
        vision_fused.ATTENTION = f"gluon:{config}" if label == "gluon" else "sdpa"

        def restore():
            vision_fused.ATTENTION = before
        return restore
    return {"config": config, **moondream_encode_rounds(["sdpa", "gluon"], switch)}


if __name__ == "__main__":
    main()
