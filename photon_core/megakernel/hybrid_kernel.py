"""The persistent kernel of the hybrid families' step programs (Qwen 3.5: Gated DeltaNet and
gated-attention layers, zero-centred RMSNorms, SwiGLU MLPs): the same machine as kernel.py
(one program per SM walks its queue of the instruction table; an instruction waits on op
counters with acquire loads and adds 1 to its own op's counter with a release), over the
op set hybrid_lowering.py emits:

  OP_HGEMV  rows [n0, n1) of a GEMV, one pipelined loop over (BN-row block, BK tile) steps
            (_hgemv: FMA at one row, tl.dot above); input: the program's scratch
            rows of a zero-centred RMSNorm it computes first (P7 = 1; of the fp32 residual x
            or the model-dtype hidden, P6) or a buffer's columns; epilogue P0: store, fp32
            residual add, gated (weights in (gate, up) row pairs: act(gate) * up)
  OP_DELTA  one (row, key head) of a Gated DeltaNet layer: conv + delta rule + gated norm,
            ops/delta_net_rows.delta_net_group (the fused backend's one-launch kernel's body)
  OP_GATTN  one key split of one (row, query head) of gated attention: q / k norms +
            rotary at pos + offset (ops/mrope._norm_rope_head, into the instruction's
            scratch), attention over its span of the row's L = min(pos + 1, CAP) positions
            (cut at run time into NSPLIT spans: every split has work while L allows), the
            cache's before L-1 (ops/gqa_attention._span_softmax) and the new key / value at
            L-1; fp32 partials into a scratch. The group's first query head's split 0 writes
            the new k / v into the cache slot (active rows only): no instruction reads it
  OP_GMERGE one (row, query head): its splits merged (_merge_splits), times sigmoid(gate)
  OP_ADVANCE, OP_ARGMAX  kernel.py's rows (row_advance, the lm pick)

Table fields per op: compiler.compile_program. The GEMV sums each output over K in BK
steps (tl.dot over 16 padded rows, exact fp32 products for fp32 weights; or FMA into
[BN, BK] summed at the block's end), in another order than the fused backend's GEMV
tiles: the diff test compares within fp32 rounding, not bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops.delta_net_rows import delta_net_group
from ..ops.gated_activation import gated_value
from ..ops.gqa_attention import _merge_splits, _span_softmax
from ..ops.mrope import _norm_rope_head
from .instructions import OP_HGEMV
from .kernel import (_STRIDE, _advance_row, _aligned, _argmax_row, _cta_sync, _globaltimer,
                     _l1_prefetch_record, _prefetch_record, _waits, finish_launch,
                     grid_options, interpreted, read_record)

EPI_STORE, EPI_RESIDUAL, EPI_GATED_SILU, EPI_GATED_GELU = 0, 2, 3, 5
EPI_ACT_MUL_GELU, EPI_ACT_MUL_SILU = 6, 7          # act(y) * mul[:, n]


@triton.jit
def _rms_rows(x_ptr, g_ptr, y_ptr, eps, zc, B: tl.constexpr, D: tl.constexpr,
              BD: tl.constexpr):
    """B rows of x (fp32 or the model dtype, row stride D) -> y (model dtype, row stride D):
    zc: x * rstd * (1 + w), rmsnorm_zero_centred's rows kernel's math; else x * rstd * w,
    layernorm.rmsnorm_row's."""
    i = tl.arange(0, BD)
    m = i < D
    w = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    if zc != 0:
        w = 1.0 + w
    for r in range(B):
        x = tl.load(x_ptr + r * D + i, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(y_ptr + r * D + i, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _hgemv_epilogue(acc, offs_b, b_ok, nb, n1, y_ptr, sy, epi, mul_ptr, smul, R: tl.constexpr,
                    BN: tl.constexpr, RED: tl.constexpr):
    """acc [R, BN] (fp32: rows offs_b of outputs nb .. nb + BN) -> y by the epilogue. RED:
    the residual add as one relaxed atomic add per element (a reduction in L2: no load round
    trip; each element has this one writer in the op, so the sum is the load + add's, bit
    for bit; the release that signals the instruction orders it), else load + add + store."""
    offs_n = nb + tl.arange(0, BN)
    mask = b_ok[:, None] & (offs_n < n1)[None, :]
    if epi == 2:        # the fp32 residual stream += acc
        ptrs = y_ptr + offs_b[:, None] * sy + offs_n[None, :]
        if RED:
            tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg") + acc,
                     mask=mask)
    elif epi == 0:
        tl.store(y_ptr + offs_b[:, None] * sy + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif epi >= 6:      # act(y) * mul (the model dtype's rounding of y first)
        t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        mv = tl.load(mul_ptr + offs_b[:, None] * smul + offs_n[None, :], mask=mask,
                     other=0.0, cache_modifier=".cg").to(tl.float32)
        if epi == 7:
            va = gated_value(t, mv, False)
        else:
            va = gated_value(t, mv, True)
        tl.store(y_ptr + offs_b[:, None] * sy + offs_n[None, :],
                 va.to(y_ptr.dtype.element_ty), mask=mask)
    else:               # (gate, up) row pairs -> act(gate) * up at column n // 2
        t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        g, u = tl.split(tl.reshape(t, [R, BN // 2, 2]))
        col = nb // 2 + tl.arange(0, BN // 2)
        ok = b_ok[:, None] & (col < n1 // 2)[None, :]
        if epi == 3:
            v = gated_value(g, u, False)
        else:
            v = gated_value(g, u, True)
        tl.store(y_ptr + offs_b[:, None] * sy + col[None, :], v.to(y_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _hgemv_begin(cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                 B: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                 ACQ: tl.constexpr, IN_PIPE: tl.constexpr, npf, RPF: tl.constexpr):
    """A GEMV instruction's waits (RPF: then the next record into L1, kernel.py's), then
    (P7 = 1) the norm of its input rows into this program's scratch wb + a_off (P4 the
    source, P5 the weight; P6: bit 0 the source is the fp32 x, bit 1 a plain RMSNorm, else
    zero-centred (1 + w)). IN_PIPE (CUDA): the CTA barrier after the norm as inline PTX (kernel._cta_sync) - Triton's pipeliner skips a loop
    that holds a gpu.barrier (kernel._wait_ln)."""
    _waits(cnt_ptr, wi0, wt0, wi1, wt1, ACQ)
    _l1_prefetch_record(npf, RPF)
    if p7 == 1:
        zc = 1 - (p6 // 2) % 2
        if p6 % 2 == 1:
            _rms_rows(fb + p4, fb + p5, wb + a_off, eps, zc, B, D, D_P2)
        else:
            _rms_rows(wb + p4, fb + p5, wb + a_off, eps, zc, B, D, D_P2)
        if IN_PIPE and ACQ:
            _cta_sync()
        else:
            tl.debug_barrier()


@triton.jit
def _hgemv(x_ptr, sx, w_ptr, y_ptr, sy, n0, n1, K, epi, mul_ptr, smul,
           cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
           B: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           IEEE: tl.constexpr, ALIGNED: tl.constexpr, FMA: tl.constexpr, GST: tl.constexpr,
           PRE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
           ACQ: tl.constexpr, RED: tl.constexpr, npf, RPF: tl.constexpr):
    """Rows [n0, n1) of y = x W^T as ONE loop over (BN-row block, BK column tile) steps,
    software-pipelined by Triton (GST stages: GST - 1 weight tiles in flight through shared
    memory, across block boundaries - no pipeline drain per block; kernel.py's _gemv_pipe's
    form, here with a run-time K: the last tile of a row masked where BK does not divide it).
    The next step's activations are loaded before this step's products (their L2 latency off
    the per-step chain). FMA (one row): products into [BN, BK], summed per block at its end;
    else tl.dot over BB (16) padded rows. ALIGNED: K a multiple of 16 and the weights
    16-aligned (vector loads; the K mask is constant over 16 columns).
    PRE: the instruction's waits and norm (_hgemv_begin) run inside step 0, after its weight
    load, and step 0's activations are loaded there: the pipeliner's prologue (the first
    GST - 1 weight tiles) is issued before the poll loop, its HBM latency overlapping the
    wait (weights never change during a step) - kernel._gemv_pipe's PRE; the same products in
    the same order. The compiler never emits an empty instruction (n_steps >= 1)."""
    if ALIGNED:
        K = (K // 16) * 16
    kt = tl.cdiv(K, BK)
    n_steps = tl.cdiv(n1 - n0, BN) * kt
    k0 = tl.arange(0, BK)
    if FMA:
        offs_b = tl.arange(0, 1)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        x_rows = x_ptr + k0
        x_mask = k0 < K
    else:
        offs_b = tl.arange(0, BB)
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        x_rows = x_ptr + offs_b[:, None] * sx + k0[None, :]
        x_mask = (offs_b < B)[:, None] & (k0 < K)[None, :]
    if PRE:         # (step 0 loads it, after the wait)
        xk = tl.zeros(x_rows.shape, dtype=x_ptr.dtype.element_ty)
    else:
        xk = tl.load(x_rows, mask=x_mask, other=0.0, cache_modifier=".cg")
    b_ok = offs_b < B
    for s in tl.range(0, n_steps, num_stages=GST):
        blk = s // kt
        kk = (s - blk * kt) * BK
        nb = n0 + blk * BN
        offs_n = nb + tl.arange(0, BN)
        k_ok = (kk + k0) < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + kk + k0[None, :],
                    mask=(offs_n < n1)[:, None] & k_ok[None, :], other=0.0)
        if PRE:
            if s == 0:
                _hgemv_begin(cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                             B, D, D_P2, ACQ, True, npf, RPF)
                xk = tl.load(x_rows, mask=x_mask, other=0.0, cache_modifier=".cg")
        kn = kk + BK
        kn = tl.where(kn < K, kn, 0)          # the next step's columns (the next block's 0)
        if FMA:
            xn = tl.load(x_ptr + kn + k0, mask=(kn + k0) < K, other=0.0, cache_modifier=".cg")
            # (the fp32 x rounded to the weights' dtype as it is used, as tl.dot's operand)
            acc += w.to(tl.float32) * xk.to(w.dtype).to(tl.float32)[None, :]
        else:
            xn = tl.load(x_ptr + offs_b[:, None] * sx + kn + k0[None, :],
                         mask=b_ok[:, None] & ((kn + k0) < K)[None, :], other=0.0,
                         cache_modifier=".cg")
            if IEEE:
                acc += tl.dot(xk.to(w.dtype), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xk.to(w.dtype), tl.trans(w))
        xk = xn
        if kk + BK >= K:                      # the block's last tile: its epilogue
            if FMA:
                _hgemv_epilogue(tl.sum(acc, axis=1)[None, :], offs_b, b_ok, nb, n1, y_ptr, sy,
                                epi, mul_ptr, smul, 1, BN, RED)
                acc = tl.zeros([BN, BK], dtype=tl.float32)
            else:
                _hgemv_epilogue(acc, offs_b, b_ok, nb, n1, y_ptr, sy, epi, mul_ptr, smul, BB,
                                BN, RED)
                acc = tl.zeros([BB, BN], dtype=tl.float32)


@triton.jit
def _gattn(qg_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, pos_ptr, off_ptr, act_ptr,
           scr_ptr, cos_ptr, sin_ptr, m_ptr, l_ptr, acc_ptr, row, h, sp, eps, scale,
           NKV: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr,
           R: tl.constexpr, NTAB: tl.constexpr, CAP: tl.constexpr, S_HEAD: tl.constexpr,
           S_POS: tl.constexpr, BS: tl.constexpr, NSPLIT: tl.constexpr):
    """Key split sp of (row, h): the row's L = min(pos + 1, CAP) positions cut into NSPLIT
    spans of whole BS tiles (at run time: every split has work while L allows); the span's
    cache positions before L-1, and the new key / value when L-1 lies in it; partials (m, l,
    acc) into the scratch for _gmerge."""
    rep: tl.constexpr = NH // NKV
    kvh = h // rep
    pos = tl.load(pos_ptr + row, cache_modifier=".cg")
    rp = tl.minimum(tl.maximum(pos + tl.load(off_ptr + row), 0), NTAB - 1)
    # (u was written by other SMs during the launch: .cg loads, L2, never a stale L1 line)
    _norm_rope_head(qg_ptr + h * 2 * HD, qw_ptr, scr_ptr, cos_ptr + rp * R, sin_ptr + rp * R,
                    HD, R, eps, BD, ".cg")
    _norm_rope_head(k_ptr + kvh * HD, kw_ptr, scr_ptr + HD, cos_ptr + rp * R,
                    sin_ptr + rp * R, HD, R, eps, BD, ".cg")
    tl.debug_barrier()          # the scratch's q / k written by every thread before the reads
    d = tl.arange(0, BD)
    dm = d < HD
    q = tl.load(scr_ptr + d, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32) * scale
    kn = tl.load(scr_ptr + HD + d, mask=dm, other=0.0,
                 cache_modifier=".cg").to(kc_ptr.dtype.element_ty)
    vn = tl.load(v_ptr + kvh * HD + d, mask=dm, other=0.0,
                 cache_modifier=".cg").to(vc_ptr.dtype.element_ty)
    slot = tl.minimum(pos, CAP - 1)
    if (h % rep == 0) & (sp == 0):     # the writer: no instruction reads the slot's old k/v
        if tl.load(act_ptr + row) != 0:
            tl.store(kc_ptr + kvh * S_HEAD + slot * S_POS + d, kn, mask=dm)
            tl.store(vc_ptr + kvh * S_HEAD + slot * S_POS + d, vn, mask=dm)
    n = tl.minimum(pos + 1, CAP)
    span = tl.cdiv(tl.cdiv(n, NSPLIT), BS) * BS
    lo = sp * span
    hi = tl.minimum(lo + span, n)
    m, l, acc = _span_softmax(q, kc_ptr + kvh * S_HEAD, vc_ptr + kvh * S_HEAD, S_POS, S_POS,
                              lo, tl.minimum(hi, n - 1), d, dm, BS, BD, "")
    if (lo <= n - 1) & (n - 1 < hi):   # the new key / value (the cache slot's values)
        m, l, acc = _merge2(m, l, acc, tl.sum(q * kn.to(tl.float32), axis=0), 1.0,
                            vn.to(tl.float32))
    i = (row * NH + h) * NSPLIT + sp
    tl.store(m_ptr + i, m)
    tl.store(l_ptr + i, l)
    tl.store(acc_ptr + i * HD + d, acc, mask=dm)


@triton.jit
def _gmerge(qg_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, row, h, NH: tl.constexpr,
            HD: tl.constexpr, BD: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr):
    """(row, h): its splits' partials merged (empty splits weigh 0), times sigmoid(gate)."""
    s = tl.arange(0, NS_P2)
    sm = s < NSPLIT
    d = tl.arange(0, BD)
    dm = d < HD
    base = (row * NH + h) * NSPLIT
    m = tl.load(m_ptr + base + s, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + base + s, mask=sm, other=0.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + (base + s)[:, None] * HD + d[None, :],
                  mask=sm[:, None] & dm[None, :], other=0.0, cache_modifier=".cg")
    o = _merge_splits(m, l, acc)
    g = tl.load(qg_ptr + h * 2 * HD + HD + d, mask=dm, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    o = o / (1.0 + tl.exp(-g))
    tl.store(out_ptr + h * HD + d, o.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _wnorm_head(x_ptr, w_ptr, o_ptr, cos_row, sin_row, eps, D: tl.constexpr,
                HAS_W: tl.constexpr, ROTATE: tl.constexpr):
    """One head of ops/rotary_half._norm_rotary_kernel (one rotate-half block): RMSNorm (times
    w, or scale-free), then rotate-half by the table row; one rounding at the end."""
    i = tl.arange(0, D)
    j = (i + D // 2) % D
    x = tl.load(x_ptr + i, cache_modifier=".cg").to(tl.float32)
    xj = tl.load(x_ptr + j, cache_modifier=".cg").to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x = x * rstd
    xj = xj * rstd
    if HAS_W:
        x = x * tl.load(w_ptr + i).to(tl.float32)
        xj = xj * tl.load(w_ptr + j).to(tl.float32)
    if ROTATE:
        c = tl.load(cos_row + i).to(tl.float32)
        s = tl.load(sin_row + i).to(tl.float32)
        x = x * c + tl.where(i < D // 2, -xj, xj) * s
    tl.store(o_ptr + i, x.to(o_ptr.dtype.element_ty))


@triton.jit
def _merge2(m1, l1, a1, m2, l2, a2):
    """Two softmax partials (max, sum, weighted values) as one (an empty one: m = -inf)."""
    m = tl.maximum(m1, m2)
    mm = tl.where(m == float("-inf"), 0.0, m)      # (both empty: weights exp(-inf) = 0)
    w1 = tl.exp(m1 - mm)
    w2 = tl.exp(m2 - mm)
    return m, l1 * w1 + l2 * w2, a1 * w1 + a2 * w2


@triton.jit
def _wattn(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
           act_ptr, scr_ptr, m_ptr, l_ptr, acc_ptr, row, h, sp, writes, ring, n_slots, eps,
           scale, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, CAP: tl.constexpr,
           BS: tl.constexpr, NSPLIT: tl.constexpr, HDM: tl.constexpr):
    """Key split sp of (row, h) of a window_attention layer (fast/window_state_ops.py): q
    (and, on a layer that writes, k with its norm and the scale-free v) normed + rotated into
    the instruction's scratch; the valid slots of the layer's (or its source's) state - a
    ring of n_slots (slot p % n_slots; the ones <= p) or the capacity (0 .. p) - cut into
    NSPLIT spans at run time; a writing layer's new slot from the scratch (the cache's old
    one skipped), its group's first head's split 0 storing k / v there (active rows); a
    KV-shared layer reads every slot from the cache (its source wrote them earlier in the
    launch: .cg). Partials into the scratch (row, h, sp) of HDM columns."""
    rep: tl.constexpr = NH // NKV
    kvh = h // rep
    p = tl.minimum(tl.load(pos_ptr + row, cache_modifier=".cg"), CAP - 1)
    _wnorm_head(q_ptr + h * D, qw_ptr, scr_ptr, cos_ptr + p * D, sin_ptr + p * D, eps, D,
                True, True)
    if writes != 0:
        _wnorm_head(k_ptr + kvh * D, kw_ptr, scr_ptr + D, cos_ptr + p * D, sin_ptr + p * D,
                    eps, D, True, True)
        _wnorm_head(v_ptr + kvh * D, kw_ptr, scr_ptr + 2 * D, cos_ptr, sin_ptr, eps, D, False,
                    False)
    tl.debug_barrier()          # the scratch written by every thread before the reads
    d = tl.arange(0, D)
    dm = d < D
    q = tl.load(scr_ptr + d, cache_modifier=".cg").to(tl.float32) * scale
    slot = tl.where(ring != 0, p % n_slots, p)
    n = tl.minimum(p + 1, n_slots)
    span = tl.cdiv(tl.cdiv(n, NSPLIT), BS) * BS
    lo = sp * span
    hi = tl.minimum(lo + span, n)
    kb = kc_ptr + (row * NKV + kvh) * n_slots * D
    vb = vc_ptr + (row * NKV + kvh) * n_slots * D
    # the cached slots but a writing layer's own (its old k / v): two spans around the cut,
    # each loaded .cg (a KV-shared layer's source wrote them during the launch). One code
    # path for both kinds of layer: with the spans' softmax in the two branches of an if,
    # Triton 3.6's layout pass moved an op of one branch into the other at some
    # specializations ("operand does not dominate this use"; bench/compile_megakernel.py
    # --from-json)
    cut = tl.where(writes != 0, slot, n)
    m, l, acc = _span_softmax(q, kb, vb, D, D, lo, tl.minimum(hi, cut), d, dm, BS, D, ".cg")
    m2, l2, a2 = _span_softmax(q, kb, vb, D, D, tl.maximum(lo, cut + 1), hi, d, dm, BS, D,
                               ".cg")
    m, l, acc = _merge2(m, l, acc, m2, l2, a2)
    if writes != 0:
        kn = tl.load(scr_ptr + D + d, cache_modifier=".cg").to(kc_ptr.dtype.element_ty)
        vn = tl.load(scr_ptr + 2 * D + d, cache_modifier=".cg").to(vc_ptr.dtype.element_ty)
        if (h % rep == 0) & (sp == 0):
            if tl.load(act_ptr + row) != 0:
                tl.store(kb + slot * D + d, kn)
                tl.store(vb + slot * D + d, vn)
        if (lo <= slot) & (slot < hi):
            s_new = tl.sum(q * kn.to(tl.float32), axis=0)
            m, l, acc = _merge2(m, l, acc, s_new, 1.0, vn.to(tl.float32))
    i = (row * NH + h) * NSPLIT + sp
    tl.store(m_ptr + i, m)
    tl.store(l_ptr + i, l)
    tl.store(acc_ptr + i * HDM + d, acc)


@triton.jit
def _wmerge(out_ptr, m_ptr, l_ptr, acc_ptr, row, h, NH: tl.constexpr, D: tl.constexpr,
            NSPLIT: tl.constexpr, NS_P2: tl.constexpr, HDM: tl.constexpr):
    s = tl.arange(0, NS_P2)
    sm = s < NSPLIT
    d = tl.arange(0, D)
    base = (row * NH + h) * NSPLIT
    m = tl.load(m_ptr + base + s, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + base + s, mask=sm, other=0.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + (base + s)[:, None] * HDM + d[None, :], mask=sm[:, None],
                  other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + h * D + d, _merge_splits(m, l, acc).to(out_ptr.dtype.element_ty))


@triton.jit
def _norm_add_row(s_ptr, w_ptr, x_ptr, scale_ptr, has_scale, eps, D: tl.constexpr,
                  BD: tl.constexpr):
    """ops/rmsnorm_residual for one row: x += RMSNorm(s) * w, then x *= scale if given."""
    c = tl.arange(0, BD)
    m = c < D
    s = tl.load(s_ptr + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = x + s / tl.sqrt(tl.sum(s * s, axis=0) / D + eps) * w
    if has_scale != 0:
        y = y * tl.load(scale_ptr).to(tl.float32)
    tl.store(x_ptr + c, y.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def hybrid_megakernel(table_ptr, queue_ptr, cnt_ptr, wb, fb, ib, ub, cos_off, sin_off,
                      act_off, m_off, l_off, acc_off, pos_off, n_prog, n_cnt, eps, scale,
                      wscale, trace_ptr,
                      B: tl.constexpr, D: tl.constexpr, SU: tl.constexpr, V: tl.constexpr,
                      LS: tl.constexpr, NK: tl.constexpr, OUT_COL: tl.constexpr,
                      BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      FMA: tl.constexpr, GST: tl.constexpr, IEEE: tl.constexpr,
                      D_P2: tl.constexpr, ARG_BLOCK: tl.constexpr,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      DK_P2: tl.constexpr, DV_P2: tl.constexpr, KC: tl.constexpr,
                      KC_P2: tl.constexpr, CS_B: tl.constexpr, CS_C: tl.constexpr,
                      CS_K: tl.constexpr, S_S: tl.constexpr,
                      NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr,
                      R: tl.constexpr, NTAB: tl.constexpr, CAP: tl.constexpr,
                      S_ROW: tl.constexpr, S_HEAD: tl.constexpr, S_POS: tl.constexpr,
                      BS: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr,
                      HD_S: tl.constexpr, HD_F: tl.constexpr, NKV_S: tl.constexpr,
                      NKV_F: tl.constexpr, BSW_S: tl.constexpr, BSW_F: tl.constexpr,
                      HDM: tl.constexpr,
                      ACQ: tl.constexpr,
                      ALIGNED: tl.constexpr = False, PRE: tl.constexpr = False,
                      TRACE: tl.constexpr = False, RED: tl.constexpr = False,
                      RPF: tl.constexpr = False):
    pid = tl.program_id(0)
    q0 = tl.load(queue_ptr + pid)
    q1 = tl.load(queue_ptr + pid + 1)
    for i in range(q0, q1):
        if TRACE:        # (start, end) of instruction i in ns: bench/trace_hybrid_megakernel.py
            tl.store(trace_ptr + 2 * i, _globaltimer())
        rec = table_ptr + i * _STRIDE
        (op, a_off, w_off, b_off, y_off, n0, n1, p0, p1, p2, p3, wi0, wt0, wi1, wt1, sig, p4,
         p5, p6, p7) = read_record(rec)
        # RPF: the record two ahead into L2 now, the next one into L1 once this one's waits
        # are acquired (kernel.py's; the last of a queue prefetches its own again)
        npf = rec + tl.where(i + 1 < q1, _STRIDE, 0)
        if RPF:
            if i + 2 < q1:
                _prefetch_record(rec + 2 * _STRIDE, False)
        if op != 6:
            _waits(cnt_ptr, wi0, wt0, wi1, wt1, ACQ)
            _l1_prefetch_record(npf, RPF)
        if op == 6:          # OP_HGEMV: its waits in _hgemv_begin
            if not PRE:     # (PRE: inside the GEMV's first step)
                _hgemv_begin(cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                             B, D, D_P2, ACQ, False, npf, RPF)
            w_off = _aligned(w_off, ALIGNED)     # (16-element vector loads of W)
            if p7 == 2:      # the input is the fp32 residual x (rounded as it is loaded)
                _hgemv(fb + a_off, p2, wb + w_off, wb + y_off, p3, n0, n1, p1, p0, wb + p4, p5,
                       cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                       B, BB, BN, BK, IEEE, ALIGNED, FMA, GST, PRE, D, D_P2, ACQ,
                       RED, npf, RPF)
            elif p0 == 2:
                _hgemv(wb + a_off, p2, wb + w_off, fb + y_off, p3, n0, n1, p1, p0, wb + p4, p5,
                       cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                       B, BB, BN, BK, IEEE, ALIGNED, FMA, GST, PRE, D, D_P2, ACQ,
                       RED, npf, RPF)
            else:
                _hgemv(wb + a_off, p2, wb + w_off, wb + y_off, p3, n0, n1, p1, p0, wb + p4, p5,
                       cnt_ptr, wi0, wt0, wi1, wt1, fb, wb, a_off, p4, p5, p6, p7, eps,
                       B, BB, BN, BK, IEEE, ALIGNED, FMA, GST, PRE, D, D_P2, ACQ,
                       RED, npf, RPF)
        elif op == 7:        # OP_DELTA: (row n0, key head n1)
            delta_net_group(wb + a_off + n0 * SU, wb + p0 + n0 * SU, wb + p1 + n0 * SU,
                            wb + p2 + n0 * SU, fb + w_off, wb + b_off + n0 * CS_B,
                            fb + p3 + n0 * S_S, wb + y_off + n0 * SU, fb + p4, fb + p5,
                            fb + p6, tl.load(ub + act_off + n0), n1, CS_C, CS_K, eps, HK, HV,
                            DK, DV, DK_P2, DV_P2, KC, KC_P2, ".cg")
        elif op == 8:        # OP_GATTN: (row n0, query head n1), key split p7
            _gattn(wb + a_off + n0 * SU, wb + p0 + n0 * SU, wb + p1 + n0 * SU,
                   wb + w_off + n0 * S_ROW, wb + b_off + n0 * S_ROW, fb + p2, fb + p3,
                   ib + p4, ib + p5, ub + act_off, wb + p6, wb + cos_off, wb + sin_off,
                   fb + m_off, fb + l_off, fb + acc_off, n0, n1, p7, eps, scale, NKV, NH, HD,
                   BD, R, NTAB, CAP, S_HEAD, S_POS, BS, NSPLIT)
        elif op == 9:        # OP_GMERGE: (row n0, query head n1)
            _gmerge(wb + a_off + n0 * SU, wb + y_off + n0 * SU, fb + m_off, fb + l_off,
                    fb + acc_off, n0, n1, NH, HD, BD, NSPLIT, NS_P2)
        elif op == 10:       # OP_WATTN: (row n0, query head n1); p7 = split | flags << 8 |
            #                  slots << 16 (flags: 1 writes, 2 ring, 4 the second head size)
            sp = p7 % 256
            fl = (p7 // 256) % 256
            ns = p7 // 65536
            if fl // 4 == 1:
                _wattn(wb + a_off + n0 * SU, wb + p0 + n0 * SU, wb + p1 + n0 * SU,
                       wb + w_off, wb + b_off, fb + p2, fb + p3, wb + p4, wb + p5, ib + pos_off,
                       ub + act_off, wb + p6, fb + m_off, fb + l_off, fb + acc_off, n0, n1,
                       sp, fl % 2, (fl // 2) % 2, ns, eps, wscale, NH, NKV_F, HD_F, CAP, BSW_F,
                       NSPLIT, HDM)
            else:
                _wattn(wb + a_off + n0 * SU, wb + p0 + n0 * SU, wb + p1 + n0 * SU,
                       wb + w_off, wb + b_off, fb + p2, fb + p3, wb + p4, wb + p5, ib + pos_off,
                       ub + act_off, wb + p6, fb + m_off, fb + l_off, fb + acc_off, n0, n1,
                       sp, fl % 2, (fl // 2) % 2, ns, eps, wscale, NH, NKV_S, HD_S, CAP, BSW_S,
                       NSPLIT, HDM)
        elif op == 11:       # OP_WMERGE: (row n0, query head n1), p7: 1 = the second size
            if p7 == 1:
                _wmerge(wb + y_off + n0 * SU, fb + m_off, fb + l_off, fb + acc_off, n0, n1, NH,
                        HD_F, NSPLIT, NS_P2, HDM)
            else:
                _wmerge(wb + y_off + n0 * SU, fb + m_off, fb + l_off, fb + acc_off, n0, n1, NH,
                        HD_S, NSPLIT, NS_P2, HDM)
        elif op == 12:       # OP_NORMADD: row n0
            _norm_add_row(wb + a_off + n0 * p0, fb + w_off, fb + y_off + n0 * D, fb + b_off, p1,
                          eps, D, D_P2)
        elif op == 4:        # OP_ADVANCE
            _advance_row(fb + a_off, wb + y_off, ub + w_off, ib + p0, ib + p1, ib + p2,
                         ib + p3, ub + b_off, n0, NK, D, D_P2)
        else:                # OP_ARGMAX
            _argmax_row(wb + a_off, ib + y_off, ib + p0, ub + p1, p2, n0, V, LS, OUT_COL,
                        ARG_BLOCK)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + sig, 1, sem="release", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 2 * i + 1, _globaltimer())
    finish_launch(cnt_ptr, n_cnt, n_prog)


def constexprs(sh: dict, stages: int = 3, pre: bool = False, red: bool = False,
               rpf: bool = False, poll1: bool = False) -> dict:
    """The kernel's constexprs for a lowering's shape dict (hybrid_lowering.HybridLowering
    .shape; also bench/compile_megakernel.py --hybrid, ahead of time without a GPU).
    stages: the GEMV loop's software-pipelining stages (the variant's "sN"); pre: a GEMV's
    waits and norm inside its loop's first step (_hgemv's PRE, the variant's "pre"); red:
    the residual epilogue as relaxed atomic adds (_hgemv_epilogue's RED, the variant's
    "red"); rpf: the records prefetched (RPF, the variant's "rpf"; inline PTX: CUDA only);
    poll1: one thread polls a wait's counters, then a CTA barrier (kernel._waits ACQ 2)."""
    kw = {k: sh[k] for k in ("B", "D", "SU", "V", "LS", "NK", "OUT_COL", "BB", "BN", "BK",
                             "FMA", "IEEE", "HK", "HV", "DK", "DV", "KC", "CS_B", "CS_C", "CS_K",
                             "S_S", "NH", "NKV", "HD", "R", "NTAB", "CAP", "S_ROW", "S_HEAD",
                             "S_POS", "BS", "NSPLIT", "HD_S", "HD_F", "NKV_S", "NKV_F",
                             "BSW_S", "BSW_F", "HDM")}
    p2 = triton.next_power_of_2
    kw.update(D_P2=p2(sh["D"]), ARG_BLOCK=min(4096, p2(sh["V"])), DK_P2=p2(sh["DK"]),
              DV_P2=p2(sh["DV"]), KC_P2=p2(sh["KC"]), BD=p2(sh["HD"]),
              NS_P2=p2(sh["NSPLIT"]),
              ACQ=0 if interpreted() else (2 if poll1 else 1), GST=int(stages),
              PRE=bool(pre), RED=bool(red), RPF=bool(rpf) and not interpreted())
    return kw


def gemv_aligned(c, low) -> bool:
    """Every GEMV instruction's weights 16-element aligned and its K a multiple of 16: the
    kernel hints them (vector loads; the K mask constant over 16 columns). From the
    instruction list on the host, once per build (MegakernelStep): nothing read back from
    the device."""
    return all((c.offsets[i.args["w"].buf] + i.args["w"].offset) % 16 == 0
               and i.params["k"] % 16 == 0 for i in c.instrs if i.op == OP_HGEMV)


def launch_args(c, low, aligned: bool = False, num_stages: int = 2, pre: bool = False,
                trace=None, red: bool = False, rpf: bool = False,
                poll1: bool = False) -> tuple[tuple, dict]:
    """hybrid_megakernel's arguments and constexprs for one step of a hybrid lowering `low`
    compiled into `c` (compiler.Compiled); aligned: gemv_aligned(c, low); trace: an int64
    tensor [n_instr, 2] for the instructions' start / end ns (CUDA; None: no trace). Also
    what bench/dump_megakernel_build.py records."""
    off = c.offsets
    kw = constexprs(low.shape, num_stages, pre, red, rpf, poll1)
    kw["ALIGNED"] = bool(aligned)
    kw["TRACE"] = trace is not None and not interpreted()
    args = (c.table, c.queue, c.counters, c.bases["w"], c.bases["f"], c.bases["i"],
            c.bases["u"], off["cos"], off["sin"], off["active"], off["attn_m"],
            off["attn_l"], off["attn_acc"], off["pos"], c.n_programs,
            c.counters.numel(), low.eps, low.shape["HD"] ** -0.5, low.window_scale,
            c.table if trace is None else trace)
    return args, kw


def launch(c, low, num_warps: int = 8, num_stages: int = 2, aligned: bool = False,
           pre: bool = False, trace=None, red: bool = False, rpf: bool = False,
           poll1: bool = False):
    """One step of a hybrid lowering `low` compiled into `c` (launch_args')."""
    args, kw = launch_args(c, low, aligned, num_stages, pre, trace, red, rpf, poll1)
    return hybrid_megakernel[(c.n_programs,)](*args, **kw, **grid_options(c),
                                              num_warps=num_warps, num_stages=num_stages)
