"""Can the decode attention's combine launch (~2.2 us per layer at 2-8 rows,
bench/probe_attention_bandwidth.py) go into the residual GEMV after it? (H200, Moondream 2's
shapes: 32 heads of 64, 1024-slot cache, rows at --pos; the residual GEMV [attention | gelu]
2048 + 8192 -> 2048 with its fp32 residual, bf16.)

  shipped   attend kernel + combine kernel + gemv() (gemv.pick's split-K tiles, TMA "auto")
  merged    attend kernel + ONE kernel: M extra programs (the lowest program ids) merge the
            (row, head) partials into the attention columns and count themselves on a flag
            (release); the GEMV programs (the same tiles, split-K) each take a share of the
            GELU columns AND of the attention columns, stream their GELU columns first, then
            wait for the flag (acquire) and stream their attention columns: the merge runs
            while the weights stream, and no launch sits between attention and GEMV.

Each as a CUDA graph over 24 layers (their own caches and weights: nothing stays in L2), us
per layer, outputs diffed (the sums' order differs: split-K atomics either way). A probe,
not an engine path: the wiring into fused_backend comes if it wins.

Usage: PYTHONPATH=. python3 bench/probe_merge_in_gemv.py [--batches 2,4,8] [--pos 760]
       TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/probe_merge_in_gemv.py --smoke   (CPU, fp32:
       the merged path against the shipped one at tiny shapes)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import photon_core.ops.decode_attention as DA  # noqa: E402
from photon_core.ops import gemv as G  # noqa: E402
from photon_core.ops._triton import tl, triton  # noqa: E402
from photon_core.ops.rope import rope_angles  # noqa: E402


@triton.jit
def _gemv_merge_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, B, N, K, stride_xb, stride_yb,
                       m_ptr, l_ptr, acc_ptr, pos_ptr, capacity, flag_ptr,
                       NH: tl.constexpr, HD: tl.constexpr, NSPLIT: tl.constexpr,
                       CHUNK: tl.constexpr, M: tl.constexpr,
                       PAIRS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                       IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if pid_n < M:
        if pid_k == 0:          # merge PAIRS (row, head) pairs, then count on the flag
            for i in range(PAIRS):
                pair = pid_n * PAIRS + i
                if pair < B * NH:
                    row = pair // NH
                    pw = tl.minimum(tl.load(pos_ptr + row), capacity - 1)
                    n_valid = DA._valid_splits(pw, CHUNK, NSPLIT)
                    DA._merge(m_ptr, l_ptr, acc_ptr, x_ptr, stride_xb, row, pair % NH, NH,
                              HD, NSPLIT, n_valid)
            tl.debug_barrier()
            tl.atomic_add(flag_ptr, 1, sem="release")
    else:
        A: tl.constexpr = NH * HD
        pid_n -= M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.arange(0, BLOCK_B)
        n_ok = offs_n < N
        b_ok = offs_b < B
        w_rows = w_ptr
        if not TMA:
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
        x_rows = x_ptr + offs_b[:, None] * stride_xb
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        f_len = (K - A) // SPLIT_K
        f0 = A + pid_k * f_len
        for kk in range(f0, f0 + f_len, BLOCK_K):        # the GELU columns: no wait
            offs_k = kk + tl.arange(0, BLOCK_K)
            w = G._weight_tile(w_ptr, w_rows, pid_n * BLOCK_N, kk, offs_k, n_ok, TMA)
            x = tl.load(x_rows + offs_k[None, :], mask=b_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x.to(w.dtype), tl.trans(w))
        while tl.atomic_add(flag_ptr, 0, sem="acquire") < M:    # the merge is done
            pass
        a_len = A // SPLIT_K
        a0 = pid_k * a_len
        for kk in range(a0, a0 + a_len, BLOCK_K):        # the attention columns
            offs_k = kk + tl.arange(0, BLOCK_K)
            w = G._weight_tile(w_ptr, w_rows, pid_n * BLOCK_N, kk, offs_k, n_ok, TMA)
            x = tl.load(x_rows + offs_k[None, :], mask=b_ok[:, None], other=0.0,
                        cache_modifier=".cg")
            if IEEE:
                acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x.to(w.dtype), tl.trans(w))
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += (bias * (pid_k == 0).to(tl.float32))[None, :]
        tl.atomic_add(y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :], acc,
                      mask=b_ok[:, None] & n_ok[None, :], sem="relaxed")


def attend_only(qkv, pos, cos, sin, kc, vc, scratch, nh, hd, chunk, warps):
    cap = kc.shape[2]
    n_split = triton.cdiv(cap, chunk)
    DA._attend_partial_kernel[(qkv.shape[0], nh, n_split)](
        qkv, qkv.stride(0), pos, cos, sin, cos.shape[0], kc, vc, kc.stride(0), kc.stride(1),
        kc.stride(2), cap, scratch.m, scratch.l, scratch.acc, hd ** -0.5, scratch.count,
        qkv, qkv.stride(0), pos, NH=nh, NKV=nh, HD=hd, HALF=cos.shape[1], CHUNK=chunk,
        NSPLIT=n_split, COMBINE=False,
        num_warps=warps, SKIP_EMPTY=True)


def gemv_merge(x, w, bias, y, scratch, pos, cap, flag, nh, hd, chunk, cfg, pairs=4):
    b, k = x.shape
    n = w.shape[0]
    n_split = triton.cdiv(cap, chunk)
    m_progs = triton.cdiv(b * nh, pairs)
    assert (k - nh * hd) % (cfg.split_k * cfg.block_k) == 0
    assert (nh * hd) % (cfg.split_k * cfg.block_k) == 0
    tma = G.tma_weights(w, cfg)
    _gemv_merge_kernel[(m_progs + triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, tma or w, bias, y, b, n, k, x.stride(0), y.stride(0), scratch.m, scratch.l,
        scratch.acc, pos, cap, flag, NH=nh, HD=hd, NSPLIT=n_split,
        CHUNK=chunk, M=m_progs, PAIRS=pairs,
        SPLIT_K=cfg.split_k, BLOCK_B=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TMA=tma is not None, IEEE=w.dtype == torch.float32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def build(b, nh, hd, cap, d, f, layers, pos_v, dev, dtype, g):
    """Per layer: qkv, caches, the residual weights / bias; shared x / y buffers."""
    kv = torch.randn(layers, 2, b, nh, cap, hd, device=dev, dtype=dtype, generator=g)
    qkv = torch.randn(layers, b, 3 * nh * hd, device=dev, dtype=dtype, generator=g)
    w = torch.randn(layers, d, nh * hd + f, device=dev, dtype=dtype, generator=g) * 0.02
    bias = torch.randn(layers, d, device=dev, dtype=torch.float32, generator=g)
    x = torch.randn(layers, b, nh * hd + f, device=dev, dtype=dtype, generator=g)
    pos = torch.full((b,), pos_v, device=dev, dtype=torch.long)
    pos[-1] = max(0, pos_v - 37)                  # rows at two positions
    return kv, qkv, w, bias, x, pos


def run_paths(b, nh, hd, cap, d, f, layers, pos_v, dev, dtype, chunk, warps, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    kv, qkv, w, bias, x, pos = build(b, nh, hd, cap, d, f, layers, pos_v, dev, dtype, g)
    cos, sin = (t.contiguous().to(dev) for t in rope_angles(torch.arange(cap + 1), 16))
    scratch = DA.AttentionScratch(b, nh, hd, cap, 128, dev, min_chunk=chunk)
    cfg = G.pick(b, d, nh * hd + f, G.EPI_RESIDUAL)
    y0 = torch.randn(layers, b, d, device=dev, generator=g)
    y = y0.clone()
    flags = torch.zeros(layers, 32, device=dev, dtype=torch.int32)
    assert DA.attend_config(b, cap, scratch) == (chunk, warps)

    def shipped():
        for i in range(layers):
            DA.decode_attention(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1],
                                x[i, :, :nh * hd], scratch, nh, nh, hd)
            G.gemv(x[i], w[i], bias[i], y[i], G.EPI_RESIDUAL)

    def merged():
        flags.zero_()
        for i in range(layers):
            attend_only(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1], scratch, nh, hd, chunk,
                        warps)
            gemv_merge(x[i], w[i], bias[i], y[i], scratch, pos, cap, flags[i, 0:1], nh, hd,
                       chunk, cfg)
    return shipped, merged, y, y0, kv


def smoke():
    """CPU (TRITON_INTERPRET=1, fp32): the merged path's outputs = the shipped path's."""
    torch.manual_seed(0)
    nh, hd, cap, d, f = 4, 32, 256, 64, 256
    outs = []
    for path in (0, 1):
        shipped, merged, y, y0, kv = run_paths(3, nh, hd, cap, d, f, 2, 150, "cpu",
                                               torch.float32, DA.ROWS_CHUNK, DA.ROWS_WARPS)
        (shipped if path == 0 else merged)()
        outs.append((y.clone(), kv.clone()))
    err = (outs[0][0] - outs[1][0]).abs().max().item()
    assert torch.equal(outs[0][1], outs[1][1]), "k/v writes differ"
    assert err < 1e-4 * (1 + outs[0][0].abs().max().item()), err
    assert (outs[0][0] - y0).abs().max().item() > 1e-3        # (it did add something)
    print(f"smoke: merged = shipped within {err:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--pos", type=int, default=760)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    from bench.bench_timing import graph_ms
    nh, hd, cap, d, f, layers = 32, 64, 1024, 2048, 8192, 24
    for b in (int(v) for v in args.batches.split(",")):
        shipped, merged, y, y0, _ = run_paths(b, nh, hd, cap, d, f, layers, args.pos, "cuda",
                                              torch.bfloat16, DA.ROWS_CHUNK, DA.ROWS_WARPS)
        res = {}
        for name, fn in (("shipped", shipped), ("merged", merged)):
            y.copy_(y0)
            fn()
            torch.cuda.synchronize()
            res[name] = y.clone()
        diff = (res["shipped"] - res["merged"]).abs().max().item()
        ref = (res["shipped"] - y0).abs().max().item()
        t = {"shipped": [], "merged": []}
        for _ in range(2):                  # each form twice, interleaved
            for name, fn in (("shipped", shipped), ("merged", merged)):
                t[name].append(f"{graph_ms(fn, calls=3) * 1e3 / layers:.2f}")
        print(f"b={b}: us per layer (attention + residual GEMV) shipped "
              f"{' / '.join(t['shipped'])}, merged {' / '.join(t['merged'])}; outputs max "
              f"|diff| {diff:.3g} (the GEMV's change {ref:.3g})", flush=True)
        del shipped, merged
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
