"""A first Gluon (Triton's explicit-layout language) form of the vision tower's attention,
head 72 as 64 + 16 columns, against SDPA (cuDNN) on the H200 - a probe, not an engine op.

Why Gluon: Triton's own pipeliner gives 2.6-2.7 ms per 9-crop encode for this attention
in every form built (sessions 4, 10, 42) against cuDNN's 2.34 ms, while the H200's units
bound it near ~0.7 ms (docs/benchmarks.md, session 42). Gluon (in the device's Triton 3.6)
exposes the pieces directly: TMA copies into NVMMA-swizzled shared memory with mbarriers,
asynchronous wgmma with the A operand in registers, explicit layouts.

This first form: one warpgroup (BM = 64 query rows) per program, K / V blocks of BN keys
double-buffered by TMA (the next blocks' copies in flight while this one computes), S = Q
K^T as two wgmmas (64 + 16 columns; q's columns past 72 zeroed in registers, so k's
neighbouring columns multiply zeros), an online softmax in the accumulator's layout (exp2,
fp32), P in bf16 from registers into two PV wgmmas (64 and 16 output columns; v's columns
past 72 land in output columns that are not stored). Keys past T in the last block: scores
-inf (their v rows - the next crop's, finite - multiply zeros). The overlap of softmax and
MMA comes from several programs per SM, not from a ping-pong inside one.

Usage (H200): PYTHONPATH=. python3 bench/probe_gluon_attention.py [--configs 64x64x2,64x128x2x1]
    (BMxBNxSTAGES[xPIPE]; BM 64: one warpgroup, 128: two; PIPE 1: the FA-3 pipeline)
A config whose output is wrong (rel. diff >= 0.01) is diagnosed at once (`diagnose`: one
crop, one key block, columns 64-71 zeroed; the error by columns / heads / row blocks /
crops), so one device call says where it goes wrong.
Writes $OUT/probe_gluon_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

HA = 64          # the head's first columns
HB = 16          # the rest (72 - 64 = 8, rounded up to a wgmma K step)


@gluon.jit
def _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, st, row, k_col, v_col):
    bar = bars.index(st)
    mbarrier.expect(bar, 2 * ka_desc.block_type.nbytes + 2 * kb_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(ka_desc, [row, k_col], bar, k_a.index(st))
    tma.async_copy_global_to_shared(kb_desc, [row, k_col + 64], bar, k_b.index(st))
    tma.async_copy_global_to_shared(ka_desc, [row, v_col], bar, v_a.index(st))
    tma.async_copy_global_to_shared(kb_desc, [row, v_col + 64], bar, v_b.index(st))


@gluon.jit
def _scores(q_a, q_b, k_a, k_b, st, s0):
    sc = warpgroup_mma(q_a, k_a.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
    return warpgroup_mma(q_b, k_b.index(st).permute((1, 0)), sc, is_async=True)


@gluon.jit
def _softmax(sc, m_i, l_i, j, T, kn, scale_log2e, BN: gl.constexpr):
    if (j + 1) * BN > T:
        sc = gl.where((j * BN + kn < T)[None, :], sc, gl.full_like(sc, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1) * scale_log2e)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _attn_kernel(qa_desc, qb_desc, ka_desc, kb_desc, o_ptr, so_b, so_t, T, scale_log2e,
                 H: gl.constexpr, HD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                 STAGES: gl.constexpr, PIPE: gl.constexpr, num_warps: gl.constexpr):
    """One program: BM query rows of one (crop, head) over every key block. PIPE:
    FlashAttention-3's in-warpgroup pipeline - block j's S = Q K_j^T and block j-1's O +=
    P V_{j-1} issued together, then block j's softmax while the PV wgmmas run, O rescaled
    by block j's alpha after they end; else each block's S, softmax, PV in turn (the
    overlap from other programs on the SM only)."""
    dt: gl.constexpr = qa_desc.dtype
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    row0 = b * T
    q_col = h * HD
    k_col = H * HD + q_col
    v_col = 2 * H * HD + q_col
    m0 = pid_m * BM
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    oa_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                   warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, 64, 16])
    ob_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                   warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, 16, 16])
    qs_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=oa_l, k_width=2)
    pb_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ob_l, k_width=2)
    q_a_s = gl.allocate_shared_memory(dt, [BM, 64], qa_desc.layout)
    q_b_s = gl.allocate_shared_memory(dt, [BM, 16], qb_desc.layout)
    k_a = gl.allocate_shared_memory(dt, [STAGES, BN, 64], ka_desc.layout)
    k_b = gl.allocate_shared_memory(dt, [STAGES, BN, 16], kb_desc.layout)
    v_a = gl.allocate_shared_memory(dt, [STAGES, BN, 64], ka_desc.layout)
    v_b = gl.allocate_shared_memory(dt, [STAGES, BN, 16], kb_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.expect(qbar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qa_desc, [row0 + m0, q_col], qbar, q_a_s)
    tma.async_copy_global_to_shared(qb_desc, [row0 + m0, q_col + 64], qbar, q_b_s)
    n_blocks = gl.cdiv(T, BN)
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, i, row0 + i * BN, k_col,
                      v_col)
    mbarrier.wait(qbar, 0)
    q_a = q_a_s.load(qs_l)
    q_b = q_b_s.load(qs_l)
    cb = gl.arange(0, 16, layout=gl.SliceLayout(0, qs_l))
    q_b = gl.where((cb < HD - 64)[None, :], q_b, gl.zeros_like(q_b))
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_l))
    o_a = gl.zeros([BM, 64], gl.float32, layout=oa_l)
    o_b = gl.zeros([BM, 16], gl.float32, layout=ob_l)
    s0 = gl.zeros([BM, BN], gl.float32, layout=s_l)
    kn = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))

    if PIPE:
        mbarrier.wait(bars.index(0), 0)
        sc = warpgroup_mma_wait(num_outstanding=0,
                                deps=(_scores(q_a, q_b, k_a, k_b, 0, s0),))
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, 0, T, kn, scale_log2e, BN)
        for j in range(1, n_blocks):
            st = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            sc = _scores(q_a, q_b, k_a, k_b, st, s0)
            p16 = p.to(dt)
            o_a = warpgroup_mma(gl.convert_layout(p16, pa_l), v_a.index(prev), o_a,
                                is_async=True)
            o_b = warpgroup_mma(gl.convert_layout(p16, pb_l), v_b.index(prev), o_b,
                                is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=2, deps=(sc,))
            p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, T, kn, scale_log2e, BN)
            o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
            if j - 1 + STAGES < n_blocks:
                _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, prev,
                          row0 + (j - 1 + STAGES) * BN, k_col, v_col)
            o_a = o_a * gl.convert_layout(alpha, gl.SliceLayout(1, oa_l))[:, None]
            o_b = o_b * gl.convert_layout(alpha, gl.SliceLayout(1, ob_l))[:, None]
        last = (n_blocks - 1) % STAGES
        p16 = p.to(dt)
        o_a = warpgroup_mma(gl.convert_layout(p16, pa_l), v_a.index(last), o_a,
                            is_async=True)
        o_b = warpgroup_mma(gl.convert_layout(p16, pb_l), v_b.index(last), o_b,
                            is_async=True)
        o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
    else:
        for j in range(n_blocks):
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            sc = warpgroup_mma_wait(num_outstanding=0,
                                    deps=(_scores(q_a, q_b, k_a, k_b, st, s0),))
            p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, T, kn, scale_log2e, BN)
            p16 = p.to(dt)
            o_a = o_a * gl.convert_layout(alpha, gl.SliceLayout(1, oa_l))[:, None]
            o_b = o_b * gl.convert_layout(alpha, gl.SliceLayout(1, ob_l))[:, None]
            o_a = warpgroup_mma(gl.convert_layout(p16, pa_l), v_a.index(st), o_a,
                                is_async=True)
            o_b = warpgroup_mma(gl.convert_layout(p16, pb_l), v_b.index(st), o_b,
                                is_async=True)
            o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
            if j + STAGES < n_blocks:
                _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, st,
                          row0 + (j + STAGES) * BN, k_col, v_col)
    mbarrier.invalidate(qbar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store(o_ptr, so_b, so_t, T, o_a, o_b, l_i, b, q_col, m0, HD, BM, oa_l, ob_l, dt)


@gluon.jit
def _store(o_ptr, so_b, so_t, T, o_a, o_b, l_i, b, q_col, m0, HD: gl.constexpr,
           BM: gl.constexpr, oa_l: gl.constexpr, ob_l: gl.constexpr, dt: gl.constexpr):
    inv_a = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, oa_l))
    inv_b = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, ob_l))
    ra = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, oa_l))
    ca = gl.arange(0, 64, layout=gl.SliceLayout(0, oa_l))
    base = o_ptr + b.to(gl.int64) * so_b + q_col
    gl.store(base + ra[:, None] * so_t + ca[None, :], (o_a * inv_a[:, None]).to(dt),
             mask=(ra < T)[:, None])
    rb = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ob_l))
    cbo = gl.arange(0, 16, layout=gl.SliceLayout(0, ob_l))
    gl.store(base + 64 + rb[:, None] * so_t + cbo[None, :], (o_b * inv_b[:, None]).to(dt),
             mask=(rb < T)[:, None] & (cbo < HD - 64)[None, :])


def gluon_attention(qkv: torch.Tensor, heads: int, bm: int = 64, bn: int = 64,
                    stages: int = 2, pipe: bool = False) -> torch.Tensor:
    """qkv [n, T, 3 H 72] bf16 (CUDA) -> o [n, T, H 72]."""
    n, t, width = qkv.shape
    hd = width // (3 * heads)
    assert 64 < hd <= 80 and qkv.is_contiguous()
    q2 = qkv.view(n * t, width)
    dt = gl.bfloat16 if qkv.dtype == torch.bfloat16 else gl.float16

    def desc(rows, cols):
        return TensorDescriptor.from_tensor(
            q2, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], dt))
    o = torch.empty(n, t, heads * hd, device=qkv.device, dtype=qkv.dtype)
    _attn_kernel[(triton.cdiv(t, bm), n * heads)](
        desc(bm, 64), desc(bm, 16), desc(bn, 64), desc(bn, 16), o, o.stride(0), o.stride(1),
        t, hd ** -0.5 * math.log2(math.e), H=heads, HD=hd, BM=bm, BN=bn, STAGES=stages,
        PIPE=pipe, num_warps=bm // 16)
    return o


def parse_config(config: str) -> tuple:
    """"BMxBNxSTAGES[xPIPE]" -> gluon_attention's (bm, bn, stages, pipe)."""
    bm, bn, st, *pp = (int(x) for x in config.split("x"))
    return bm, bn, st, bool(pp and pp[0])


def diagnose(config: str, heads: int = 16, hd: int = 72, t: int = 729, attn=None,
             device: str = "cuda") -> dict:
    """Where a wrong config goes wrong (one device call should say more than "wrong"): the
    max error over |ref| max of the kernel on inputs that take one piece away each -
    one crop (no crop offsets), one key block of BN keys (no online softmax / pipeline
    phases), head columns 64-71 zero in q, k and v (the 16-column boxes carry nothing) -
    and, on the 9-crop input, the error split by output columns (0-63 / 64-71), by heads,
    by query-row block, by crop."""
    from photon_core.ops.vision_attention import vision_attention_reference
    bm, bn, _, _ = parse_config(config)
    attn = attn or gluon_attention
    g = torch.Generator(device).manual_seed(11)

    def err(qkv):
        ref = vision_attention_reference(qkv.float(), heads)
        got = attn(qkv, heads, *parse_config(config)).float()
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
    ap.add_argument("--encode-ab", action="store_true",
                    help="then the encode graph with SDPA vs the fastest config that is "
                         "right (rel. diff < 0.01) and faster than SDPA, ABBA x 2")
    args = ap.parse_args()
    heads, t, hd, layers = 16, 729, 72, 27
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
            r = row(lambda c=c: gluon_attention(qkv, heads, *parse_config(c)))
            r["vs_sdpa"] = round(out["rows"]["sdpa"]["ms_per_encode"] / r["ms_per_encode"], 3)
        except Exception as e:  # noqa: BLE001
            r = {"error": repr(e)[:400]}
        if r.get("rel_diff_vs_fp32", 0) >= 0.01:
            try:
                r["diagnose"] = diagnose(c)
            except Exception as e:  # noqa: BLE001
                r["diagnose"] = {"error": repr(e)[:400]}
        out["rows"][c] = r
        print(c, r, flush=True)
        if "illegal" in repr(r):
            break
    write_json("probe_gluon_attention.json", out)
    ok = {c: r for c, r in out["rows"].items() if c != "sdpa" and "ms_per_encode" in r
          and r["rel_diff_vs_fp32"] < 0.01 and r["vs_sdpa"] > 1.0}
    if args.encode_ab and ok:
        best = min(ok, key=lambda c: ok[c]["ms_per_encode"])
        out["encode_ab"] = encode_ab(best)
        write_json("probe_gluon_attention.json", out)


def encode_ab(config: str) -> dict:
    """The runtime's 9-crop encode graph with SDPA vs this config's kernel (vision_fused's
    attention="triton" path with its vision_attention replaced; ab_encode.
    moondream_encode_rounds)."""
    from bench.ab_encode import moondream_encode_rounds
    from photon_core.models.moondream2 import vision_fused
    orig = vision_fused.vision_attention

    def switch(label):
        if label == "gluon":
            vision_fused.ATTENTION = "triton"
            vision_fused.vision_attention = lambda qkv, heads, _cfg=None: gluon_attention(
                qkv, heads, *parse_config(config))

        def restore():
            vision_fused.ATTENTION, vision_fused.vision_attention = "sdpa", orig
        return restore
    return {"config": config, **moondream_encode_rounds(["sdpa", "gluon"], switch)}


if __name__ == "__main__":
    main()
