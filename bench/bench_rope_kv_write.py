"""ops/rope_kv_write.py on the GPU: the kernel before issue 13's rework (main 5afc237: one
program per (token, 32 head slots), three loads of the row; its code is kept below, comments
trimmed, for this comparison only) vs the current one (blocks of tokens x heads of one kind,
each channel loaded once), at the image-prefix prefill's real shapes: Moondream 2's text
model, 730 tokens, 32 q + 32 kv heads of 64, rot 32, bf16, 1 and 4 frames, k / v into
kv[i, 0] / kv[i, 1] of the prefix buffer [24, 2, n, 32, 730, 64] (strided views).

Timed as CUDA graphs of 24 back-to-back calls (the encode's 24 layers), median of the
replays, in two modes: "hbm" (24 distinct layers' qkv and cache slots, 216 MB of qkv at
n=1: the inputs come from HBM) and "l2" (one layer's buffers 24 times: an L2-warm input, as
when the qkv GEMM has just written it). Per call: time, effective GB/s (bytes read + written:
qkv once, q + k + v once), the ratio old / new, and a device-to-device copy of the same
bytes as the roofline. Every launch configuration timed is first checked bitwise against the
old kernel (q, k and v, torch.equal): the decode step relies on the cached k being what its
own kernel writes. A small sweep of (tokens_per_program, heads_per_program, num_warps)
follows the default configuration; the fastest is reported.

Usage: PYTHONPATH=. python3 bench/bench_rope_kv_write.py [--no-sweep] [--reps 50]
Prints a JSON line last; writes $OUT/bench_rope_kv_write.json when OUT is set. Exit 1 when
any output differs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_kernels import graph_ms  # noqa: E402
from photon_core.ops._triton import tl, triton  # noqa: E402
from photon_core.ops.decode_attention import rotary_sources  # noqa: E402
from photon_core.ops.rope import rope_angles  # noqa: E402
from photon_core.ops.rope_kv_write import rope_kv_write  # noqa: E402

NH = NKV = 32
HD, ROT, T, LAYERS = 64, 32, 730, 24
SWEEP = [(tb, hb, w) for tb in (1, 2, 4, 8, 16) for hb in (16, 32) for w in (4, 8)]


# --- the kernel of main 5afc237 (before the rework), for this comparison only -------------
@triton.jit
def _old_kernel(qkv_ptr, s_qkv_b, s_qkv_t, cos_ptr, sin_ptr,
                q_ptr, s_q_b, s_q_t,
                k_ptr, s_k_b, s_k_h, s_k_t,
                v_ptr, s_v_b, s_v_h, s_v_t, T,
                NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                HD_P2: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)          # b * T + t
    b = row // T
    t = row % T
    j = tl.program_id(1) * HB + tl.arange(0, HB)  # head slot: q heads, then k, then v
    d = tl.arange(0, HD_P2)
    n_slots: tl.constexpr = NH + 2 * NKV
    slot_ok = j < n_slots
    d_ok = d < HD
    ok = slot_ok[:, None] & d_ok[None, :]
    src_c, src_s, c, s = rotary_sources(d, cos_ptr, sin_ptr, t, HALF)
    rot_d = d < 2 * HALF
    base = qkv_ptr + b * s_qkv_b + t * s_qkv_t + j[:, None] * HD
    raw = tl.load(base + d[None, :], mask=ok, other=0.0)
    is_qk = (j < NH + NKV)[:, None]
    rot = is_qk & rot_d[None, :]
    xc = tl.load(base + src_c[None, :], mask=ok & rot, other=0.0).to(tl.float32)
    xs = tl.load(base + src_s[None, :], mask=ok & rot, other=0.0).to(tl.float32)
    r = xc * c[None, :] + xs * s[None, :]
    is_q = (j < NH)[:, None]
    q_val = tl.where(rot, r, raw.to(tl.float32)).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + b * s_q_b + t * s_q_t + j[:, None] * HD + d[None, :], q_val,
             mask=ok & is_q)
    kh = tl.where(is_qk & ~is_q, j[:, None] - NH, 0)
    k_val = tl.where(rot, r, raw.to(tl.float32)).to(k_ptr.dtype.element_ty)
    tl.store(k_ptr + b * s_k_b + kh * s_k_h + t * s_k_t + d[None, :], k_val,
             mask=ok & is_qk & ~is_q)
    vh = tl.where(~is_qk, j[:, None] - NH - NKV, 0)
    tl.store(v_ptr + b * s_v_b + vh * s_v_h + t * s_v_t + d[None, :],
             raw.to(v_ptr.dtype.element_ty), mask=ok & ~is_qk)


def old_rope_kv_write(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache):
    """main 5afc237's launcher (its shape checks left out: the shapes here are fixed)."""
    n, t, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv_heads)
    half = cos.shape[-1]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q = torch.empty(n, t, n_heads, hd, device=qkv.device, dtype=qkv.dtype)
    slots = n_heads + 2 * n_kv_heads
    hb = min(triton.next_power_of_2(slots), 32)
    _old_kernel[(n * t, triton.cdiv(slots, hb))](
        qkv, qkv.stride(0), qkv.stride(1), cos, sin,
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), t,
        NH=n_heads, NKV=n_kv_heads, HD=hd, HD_P2=triton.next_power_of_2(hd), HALF=half,
        HB=hb, num_warps=4)
    return q
# -------------------------------------------------------------------------------------------


def per_call_us(fn, qkvs, kv, cos, sin, mode, reps):
    """fn over the 24 layers as one graph -> us per call. mode "hbm": layer i's own qkv
    and cache slot; "l2": layer 0's, 24 times."""
    def calls():
        for i in range(LAYERS):
            j = i if mode == "hbm" else 0
            fn(qkvs[j], cos, sin, NH, NKV, kv[j, 0], kv[j, 1])
    return graph_ms(calls, reps) * 1e3 / LAYERS


def copy_us(nbytes, reps):
    """A device-to-device copy moving nbytes (read + write), 24 distinct buffers."""
    n = nbytes // 2 // 2
    src = [torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(LAYERS)]
    dst = [torch.empty_like(x) for x in src]

    def calls():
        for a, b in zip(src, dst):
            b.copy_(a)
    return graph_ms(calls, reps) * 1e3 / LAYERS


def outputs(fn, qkv, cos, sin, n, **kw):
    kv = torch.full((2, n, NKV, T, HD), float("nan"), dtype=qkv.dtype, device="cuda")
    q = fn(qkv, cos, sin, NH, NKV, kv[0], kv[1], **kw)
    torch.cuda.synchronize()
    return q, kv


def same(a, b):
    (qa, kva), (qb, kvb) = a, b
    return bool(torch.equal(qa, qb) and torch.equal(kva[0], kvb[0])
                and torch.equal(kva[1], kvb[1]))


def run_shape(n, cos, sin, sweep, reps):
    g = torch.Generator(device="cuda").manual_seed(n)
    qkvs = [(torch.randn(n, T, (NH + 2 * NKV) * HD, device="cuda", generator=g) * 2)
            .to(torch.bfloat16) for _ in range(LAYERS)]
    kv = torch.zeros(LAYERS, 2, n, NKV, T, HD, dtype=torch.bfloat16, device="cuda")
    nbytes = 2 * qkvs[0].numel() * qkvs[0].element_size()     # qkv read, q + k + v written
    ref = outputs(old_rope_kv_write, qkvs[0], cos, sin, n)
    res = {"n": n, "T": T, "bytes_per_call": nbytes,
           "copy_us": copy_us(nbytes, reps)}
    res["copy_gbps"] = nbytes / res["copy_us"] / 1e3
    for mode in ("hbm", "l2"):
        res[f"old_{mode}_us"] = per_call_us(old_rope_kv_write, qkvs, kv, cos, sin, mode, reps)
    configs = [None] + (SWEEP if sweep else [])
    rows = []
    for cfg in configs:
        kw = {} if cfg is None else dict(tokens_per_program=cfg[0], heads_per_program=cfg[1],
                                         num_warps=cfg[2])

        def fn(*a, kw=kw):
            return rope_kv_write(*a, **kw)
        row = {"config": "default" if cfg is None else
               f"tokens={cfg[0]} heads={cfg[1]} warps={cfg[2]}",
               "equal": same(ref, outputs(fn, qkvs[0], cos, sin, n))}
        for mode in ("hbm", "l2"):
            row[f"{mode}_us"] = per_call_us(fn, qkvs, kv, cos, sin, mode, reps)
            row[f"{mode}_gbps"] = nbytes / row[f"{mode}_us"] / 1e3
            row[f"{mode}_speedup"] = res[f"old_{mode}_us"] / row[f"{mode}_us"]
        rows.append(row)
        print(f"  n={n} {row['config']:28s} equal={row['equal']}  hbm {row['hbm_us']:7.2f} us "
              f"({row['hbm_gbps']:6.0f} GB/s, x{row['hbm_speedup']:.2f})  l2 "
              f"{row['l2_us']:7.2f} us ({row['l2_gbps']:6.0f} GB/s, x{row['l2_speedup']:.2f})",
              flush=True)
    new = rows[0]
    for mode in ("hbm", "l2"):
        res[f"new_{mode}_us"] = new[f"{mode}_us"]
        res[f"old_{mode}_gbps"] = nbytes / res[f"old_{mode}_us"] / 1e3
        res[f"new_{mode}_gbps"] = new[f"{mode}_gbps"]
        res[f"ratio_{mode}"] = res[f"old_{mode}_us"] / new[f"{mode}_us"]
    res["equal"] = new["equal"]
    res["all_configs_equal"] = all(r["equal"] for r in rows)
    res["best_hbm"] = min(rows, key=lambda r: r["hbm_us"])["config"]
    res["best_l2"] = min(rows, key=lambda r: r["l2_us"])["config"]
    res["sweep"] = rows
    del qkvs, kv
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    cos, sin = (x.cuda() for x in rope_angles(torch.arange(T), ROT))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "shapes": []}
    for n in (1, 4):
        r = run_shape(n, cos, sin, not a.no_sweep, a.reps)
        out["shapes"].append(r)
        for mode in ("hbm", "l2"):
            print(f"n={n} T={T} {mode}: old {r[f'old_{mode}_us']:.2f} us "
                  f"({r[f'old_{mode}_gbps']:.0f} GB/s), new {r[f'new_{mode}_us']:.2f} us "
                  f"({r[f'new_{mode}_gbps']:.0f} GB/s), old/new x{r[f'ratio_{mode}']:.2f}; "
                  f"copy of the same bytes {r['copy_us']:.2f} us ({r['copy_gbps']:.0f} GB/s); "
                  f"best {r[f'best_{mode}']}", flush=True)
        print(f"n={n} bitwise equal to the old kernel: default {r['equal']}, every config "
              f"{r['all_configs_equal']}", flush=True)
    out["all_equal"] = all(r["all_configs_equal"] for r in out["shapes"])
    line = json.dumps(out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_rope_kv_write.json").write_text(line + "\n")
    print(line)
    sys.exit(0 if out["all_equal"] else 1)


if __name__ == "__main__":
    main()
