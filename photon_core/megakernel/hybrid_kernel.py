"""The persistent kernel of the hybrid families' step programs (Qwen 3.5: Gated DeltaNet and
gated-attention layers, zero-centred RMSNorms, SwiGLU MLPs): the same machine as kernel.py
(one program per SM walks its queue of the instruction table; an instruction waits on op
counters with acquire loads and adds 1 to its own op's counter with a release), over the
op set hybrid_lowering.py emits:

  OP_HGEMV  rows [n0, n1) of a GEMV, in BN-row blocks over K; input: the program's scratch
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
steps with tl.dot (16 rows; exact fp32 products for fp32 weights), in another order than
the fused backend's GEMV tiles: the diff test compares within fp32 rounding, not bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops.delta_net_rows import delta_net_group
from ..ops.gated_activation import gated_value
from ..ops.gqa_attention import _merge_splits, _span_softmax
from ..ops.mrope import _norm_rope_head
from .instructions import F_OP, F_W, OP_HGEMV
from .kernel import _STRIDE, _advance_row, _aligned, _argmax_row, _waits, interpreted

EPI_STORE, EPI_RESIDUAL, EPI_GATED_SILU, EPI_GATED_GELU = 0, 2, 3, 5


@triton.jit
def _rms_zc_rows(x_ptr, g_ptr, y_ptr, eps, B: tl.constexpr, D: tl.constexpr,
                 BD: tl.constexpr):
    """B rows of x (fp32 or the model dtype, row stride D) -> y (model dtype, row stride D):
    x * rstd * (1 + w), rmsnorm_zero_centred's rows kernel's math."""
    i = tl.arange(0, BD)
    m = i < D
    w = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    for r in range(B):
        x = tl.load(x_ptr + r * D + i, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(y_ptr + r * D + i, (x * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _hgemv(x_ptr, sx, w_ptr, y_ptr, sy, n0, n1, K, epi, B: tl.constexpr, BB: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    offs_b = tl.arange(0, BB)
    b_ok = offs_b < B
    K = (K // 16) * 16      # (K % BK == 0: the same K) its rows start 16-aligned: vector loads
    for nb in range(n0, n1, BN):
        offs_n = nb + tl.arange(0, BN)
        n_ok = offs_n < n1
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + offs_b[:, None] * sx + offs_k[None, :], mask=b_ok[:, None],
                        other=0.0, cache_modifier=".cg")
            if IEEE:
                acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x.to(w.dtype), tl.trans(w))
        mask = b_ok[:, None] & n_ok[None, :]
        if epi == 2:        # the fp32 residual stream += acc
            ptrs = y_ptr + offs_b[:, None] * sy + offs_n[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg") + acc,
                     mask=mask)
        elif epi == 0:
            tl.store(y_ptr + offs_b[:, None] * sy + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:               # (gate, up) row pairs -> act(gate) * up at column n // 2
            t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            g, u = tl.split(tl.reshape(t, [BB, BN // 2, 2]))
            col = nb // 2 + tl.arange(0, BN // 2)
            ok = b_ok[:, None] & (col < n1 // 2)[None, :]
            if epi == 3:
                v = gated_value(g, u, False)
            else:
                v = gated_value(g, u, True)
            tl.store(y_ptr + offs_b[:, None] * sy + col[None, :], v.to(y_ptr.dtype.element_ty),
                     mask=ok)


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
                              lo, tl.minimum(hi, n - 1), d, dm, BS, BD)
    if (lo <= n - 1) & (n - 1 < hi):   # the new key / value (the cache slot's values)
        s_new = tl.sum(q * kn.to(tl.float32), axis=0)
        m2 = tl.maximum(m, s_new)
        alpha = tl.exp(m - m2)
        p = tl.exp(s_new - m2)
        l = l * alpha + p
        acc = acc * alpha + p * vn.to(tl.float32)
        m = m2
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
def hybrid_megakernel(table_ptr, queue_ptr, cnt_ptr, wb, fb, ib, ub, cos_off, sin_off,
                      act_off, m_off, l_off, acc_off, n_prog, n_cnt, eps, scale,
                      B: tl.constexpr, D: tl.constexpr, SU: tl.constexpr, V: tl.constexpr,
                      LS: tl.constexpr, NK: tl.constexpr, OUT_COL: tl.constexpr,
                      BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      IEEE: tl.constexpr, D_P2: tl.constexpr, ARG_BLOCK: tl.constexpr,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      DK_P2: tl.constexpr, DV_P2: tl.constexpr, KC: tl.constexpr,
                      KC_P2: tl.constexpr, CS_B: tl.constexpr, CS_C: tl.constexpr,
                      CS_K: tl.constexpr, S_S: tl.constexpr,
                      NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr,
                      R: tl.constexpr, NTAB: tl.constexpr, CAP: tl.constexpr,
                      S_ROW: tl.constexpr, S_HEAD: tl.constexpr, S_POS: tl.constexpr,
                      BS: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr,
                      SLEEP: tl.constexpr, ACQ: tl.constexpr,
                      ALIGNED: tl.constexpr = False):
    pid = tl.program_id(0)
    q0 = tl.load(queue_ptr + pid)
    q1 = tl.load(queue_ptr + pid + 1)
    for i in range(q0, q1):
        rec = table_ptr + i * _STRIDE
        op = tl.load(rec + 0)
        a_off = tl.load(rec + 1)
        w_off = tl.load(rec + 2)
        b_off = tl.load(rec + 3)
        y_off = tl.load(rec + 4)
        n0 = tl.load(rec + 5).to(tl.int32)
        n1 = tl.load(rec + 6).to(tl.int32)
        p0 = tl.load(rec + 7)
        p1 = tl.load(rec + 8)
        p2 = tl.load(rec + 9)
        p3 = tl.load(rec + 10)
        wi0 = tl.load(rec + 11).to(tl.int32)
        wt0 = tl.load(rec + 12).to(tl.int32)
        wi1 = tl.load(rec + 13).to(tl.int32)
        wt1 = tl.load(rec + 14).to(tl.int32)
        sig = tl.load(rec + 15)
        p4 = tl.load(rec + 16)
        p5 = tl.load(rec + 17)
        p6 = tl.load(rec + 18)
        p7 = tl.load(rec + 19)
        _waits(cnt_ptr, wi0, wt0, wi1, wt1, SLEEP, ACQ)
        if op == 6:          # OP_HGEMV
            if p7 == 1:      # the norm into this program's scratch rows first
                if p6 == 1:
                    _rms_zc_rows(fb + p4, fb + p5, wb + a_off, eps, B, D, D_P2)
                else:
                    _rms_zc_rows(wb + p4, fb + p5, wb + a_off, eps, B, D, D_P2)
                tl.debug_barrier()
            w_off = _aligned(w_off, ALIGNED)     # (16-element vector loads of W)
            if p0 == 2:
                _hgemv(wb + a_off, p2, wb + w_off, fb + y_off, p3, n0, n1, p1, p0, B, BB, BN,
                       BK, IEEE)
            else:
                _hgemv(wb + a_off, p2, wb + w_off, wb + y_off, p3, n0, n1, p1, p0, B, BB, BN,
                       BK, IEEE)
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
        elif op == 4:        # OP_ADVANCE
            _advance_row(fb + a_off, wb + y_off, ub + w_off, ib + p0, ib + p1, ib + p2,
                         ib + p3, ub + b_off, n0, NK, D, D_P2)
        else:                # OP_ARGMAX
            _argmax_row(wb + a_off, ib + y_off, ib + p0, ub + p1, p2, n0, V, LS, OUT_COL,
                        ARG_BLOCK)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + sig, 1, sem="release", scope="gpu")
    done = tl.atomic_add(cnt_ptr + n_cnt - 1, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:          # every program is past its queue: reset for next launch
        for c0 in range(0, n_cnt, 128):
            offs = c0 + tl.arange(0, 128)
            tl.store(cnt_ptr + offs, tl.zeros([128], dtype=tl.int32), mask=offs < n_cnt)


def constexprs(sh: dict, sleep: int = 0) -> dict:
    """The kernel's constexprs for a lowering's shape dict (hybrid_lowering.HybridLowering
    .shape; also bench/compile_megakernel.py --hybrid, ahead of time without a GPU)."""
    kw = {k: sh[k] for k in ("B", "D", "SU", "V", "LS", "NK", "OUT_COL", "BB", "BN", "BK",
                             "IEEE", "HK", "HV", "DK", "DV", "KC", "CS_B", "CS_C", "CS_K",
                             "S_S", "NH", "NKV", "HD", "R", "NTAB", "CAP", "S_ROW", "S_HEAD",
                             "S_POS", "BS", "NSPLIT")}
    p2 = triton.next_power_of_2
    kw.update(D_P2=p2(sh["D"]), ARG_BLOCK=min(4096, p2(sh["V"])), DK_P2=p2(sh["DK"]),
              DV_P2=p2(sh["DV"]), KC_P2=p2(sh["KC"]), BD=p2(sh["HD"]),
              NS_P2=p2(sh["NSPLIT"]),
              SLEEP=0 if interpreted() else int(sleep), ACQ=not interpreted())
    return kw


def launch(c, low, num_warps: int = 8, num_stages: int = 2, sleep: int = 0):
    """One step of a hybrid lowering `low` compiled into `c` (compiler.Compiled)."""
    off = c.offsets
    kw = constexprs(low.shape, sleep)
    t = c.table
    gemv_w = t[t[:, F_OP] == OP_HGEMV][:, F_W]
    kw["ALIGNED"] = bool((gemv_w % 16 == 0).all())     # every GEMV's weights 16-aligned
    args = (c.table, c.queue, c.counters, c.bases["w"], c.bases["f"], c.bases["i"],
            c.bases["u"], off["cos"], off["sin"], off["active"], off["attn_m"],
            off["attn_l"], off["attn_acc"], c.n_programs,
            c.counters.numel(), low.eps, low.shape["HD"] ** -0.5)
    if interpreted():
        assert c.n_programs == 1, "the interpreter runs programs one after another: " \
                                  "compile with n_sm=1"
    else:
        kw["launch_cooperative_grid"] = True
    return hybrid_megakernel[(c.n_programs,)](*args, **kw, num_warps=num_warps,
                                              num_stages=num_stages)
