"""The persistent megakernel: one program per SM (or two: megakernel_step.Variant per_sm),
each walks its own queue of the instruction table (compiler.py) and runs every instruction
with an op switch.

Synchronization (no grid-wide barrier): every instruction
  - reads all its table fields at its start (one round trip; the record two ahead is
    prefetched into L2 on CUDA);
  - waits for up to two op counters to reach their targets: on CUDA both polled in one loop
    of per-thread `ld.acquire.gpu` loads (no atomic, no bar.sync per iteration; the acquire
    orders the reads after it); under the interpreter a volatile spin + an acquire atomic;
    (Variant pre: a pipe GEMV waits inside its pipelined loop's first step, the loop's
    first weight tiles already in flight: _gemv_pipe);
  - runs its op; activations are read with .cg (L2, not a stale L1 line of an earlier layer);
  - publishes: a CTA barrier (all threads' stores issued) then one release atomic add on its
    op's counter.
The last program to finish (a counter of finished programs) zeroes all counters, so the next
launch (stream-ordered) starts from 0: a CUDA graph can replay it.
On CUDA the launch is cooperative (launch_cooperative_grid=True): a grid larger than what
can be resident at once fails at launch instead of spinning forever. Under TRITON_INTERPRET=1
programs run one after another, so only a one-program schedule can run there.

Ops (arithmetic as the fused backend's kernels, ops/*.py, with the same block shapes, so
each output is summed in the same order):
  LN        one row: F.layer_norm in fp32, rounded to the model dtype (layernorm.py)
  GEMV_W1   rows [n0, n1) of [Wqkv; Wfc1]: qkv store / gelu_tanh into u (gemv.py EPI 1)
  GEMV_W2   rows [n0, n1) of [Wproj, Wfc2]: x += (EPI 2, no split-K)
  GEMV_LM   rows [n0, n1) of the lm head (EPI 0)
  ATTN      key splits [s0, s1) of one (row, head): rotary, k/v write, the split partials of
            decode_attention.py, one split after another, into the scratch
  COMBINE   one (row, head): decode_attention.py's _merge of the splits into u[:, a]
  ADVANCE   one row: row_advance.py (phase by the program's phase table)
  ARGMAX    one row: masked_argmax.py (the answer-marker rule)
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from ..ops.decode_attention import _merge, rotary_sources, scores, split_partials
from .compiler import CNT_STRIDE

_STRIDE = tl.constexpr(20)     # instructions.N_FIELDS


@triton.jit
def _globaltimer():
    """The GPU's global nanosecond timer (the same clock on every SM: trace timestamps)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _wait(cnt_ptr, idx, target):
    if idx >= 0:
        while tl.load(cnt_ptr + idx, volatile=True) < target:
            pass
        tl.atomic_add(cnt_ptr + idx, 0, sem="acquire", scope="gpu")


@triton.jit
def _ld_acquire(ptr):
    """ld.acquire.gpu of one int32 by every thread: the reads after it see what the writer
    published with its release (no separate fence or atomic)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_line(ptr, L1: tl.constexpr):
    """prefetch.global.L1 (L1) / .L2 of the line holding ptr (a hint: no result, no
    ordering)."""
    level: tl.constexpr = "L1" if L1 else "L2"
    tl.inline_asm_elementwise("prefetch.global." + level + " [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptr.to(tl.int64, bitcast=True)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_record(rec, L1: tl.constexpr):
    """The two cache lines of the (160-byte) record at rec into L1 / L2 (the table never
    changes during a launch)."""
    _prefetch_line(rec, L1)
    _prefetch_line(rec + _STRIDE - 1, L1)


@triton.jit
def _l1_prefetch_record(rec, RPF: tl.constexpr):
    """RPF: the next instruction's record (rec) into L1, once the current one's last
    acquire is done (an acquire load invalidates L1: CCTL.IVALL), so its start reads its
    fields from L1 instead of an L2 round trip."""
    if RPF:
        _prefetch_record(rec, True)


@triton.jit
def _poll_one(c0, g0, c1, g1):
    """ACQ == 2: thread 0 alone polls both counters with acquire loads until they reach
    their targets, then the CTA barrier (bar.sync 0) lets every thread on: its loads are
    ordered after thread 0's acquire (barrier synchronization is transitive with it), and
    the counters' L2 line sees one poll per program per round instead of one per warp and
    counter."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .pred pw;\n\t.reg .b32 pt, pa, pb;\n\t"
        "mov.u32 pt, %tid.x;\n\tsetp.ne.u32 pw, pt, 0;\n\t@pw bra POLL_DONE;\n"
        "POLL_LOOP:\n\tld.acquire.gpu.global.b32 pa, [$1];\n\t"
        "ld.acquire.gpu.global.b32 pb, [$3];\n\tsetp.lt.s32 pw, pa, $2;\n\t"
        "setp.lt.or.s32 pw, pb, $4, pw;\n\t@pw bra POLL_LOOP;\n"
        "POLL_DONE:\n\tbar.sync 0;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r,l,r", [c0, g0, c1, g1], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _waits(cnt_ptr, i0, t0, i1, t1, ACQ: tl.constexpr):
    """The instruction's (up to) two waits (counter, target: table fields 11..14, read at
    the instruction's start). ACQ (CUDA): both counters polled in one loop by acquire loads,
    one round trip when both are already reached (session 4 had a spin + an acquire atomic
    per counter, one after the other) - by every thread (1), or by thread 0 then a CTA
    barrier (2: _poll_one); under the interpreter a volatile spin each."""
    if ACQ:
        if (i0 >= 0) | (i1 >= 0):
            c0 = cnt_ptr + tl.maximum(i0, 0)
            c1 = cnt_ptr + tl.maximum(i1, 0)
            g0 = tl.where(i0 >= 0, t0, 0)       # no wait: target 0 (counters are >= 0)
            g1 = tl.where(i1 >= 0, t1, 0)
            if ACQ == 2:
                _poll_one(c0, g0, c1, g1)
            else:
                while (_ld_acquire(c0) < g0) | (_ld_acquire(c1) < g1):
                    pass
    else:
        _wait(cnt_ptr, i0, t0)
        _wait(cnt_ptr, i1, t1)


@triton.jit
def _cta_sync():
    """bar.sync 0 as inline PTX (tl.debug_barrier's CTA barrier, which also orders the
    threads' global stores before the reads after it), hidden from Triton's passes."""
    tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _aligned(off, ALIGNED: tl.constexpr):
    if ALIGNED:
        off = (off // 16) * 16
    return off


@triton.jit
def _wait_ln(cnt_ptr, wb, fb, a_off, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
             B: tl.constexpr, D: tl.constexpr, LN_BLOCK: tl.constexpr,
             ALIGNED: tl.constexpr, ACQ: tl.constexpr,
             IN_PIPE: tl.constexpr, tr_ptr, TRACE: tl.constexpr, npf, RPF: tl.constexpr):
    """A GEMV instruction's waits, then its fused LayerNorm of the bucket's rows into this
    program's scratch wb + a_off (fields 16..19: input, gamma, beta, input is fp32 (1) /
    model dtype (0) / no LayerNorm (-1): the scratch already holds it). IN_PIPE (CUDA): the
    CTA barrier after the LayerNorm as inline PTX, not tl.debug_barrier, for a caller inside
    a loop that Triton is to software-pipeline (_gemv_pipe PRE): Triton's pipeliner skips a
    loop that holds a gpu.barrier (it does pipeline one that holds the poll loop and the
    LayerNorm's row loop: sm_90 builds with Triton 3.6 and 3.9). TRACE: the times its
    inputs were ready and its LayerNorm done into tr_ptr[1], [2] (megakernel's trace row).
    RPF: the next instruction's record (npf) into L1 after the waits."""
    _waits(cnt_ptr, wi0, wt0, wi1, wt1, ACQ)
    _l1_prefetch_record(npf, RPF)
    if TRACE:
        tl.store(tr_ptr + 1, _globaltimer())
    in_f32 = f19
    if in_f32 >= 0:
        ln_in = _aligned(f16, ALIGNED)
        g_off = _aligned(f17, ALIGNED)
        be_off = _aligned(f18, ALIGNED)
        if in_f32 != 0:
            _ln_rows(fb + ln_in, wb + g_off, wb + be_off, wb + a_off, eps, B, D, LN_BLOCK)
        else:
            _ln_rows(wb + ln_in, wb + g_off, wb + be_off, wb + a_off, eps, B, D, LN_BLOCK)
        if IN_PIPE and ACQ:
            _cta_sync()
        else:
            tl.debug_barrier()
    if TRACE:
        tl.store(tr_ptr + 2, _globaltimer())


@triton.jit
def _gemv_pipe(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_x, stride_y,
               cnt_ptr, wb, fb, a_off, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
               B: tl.constexpr, K: tl.constexpr, EPI: tl.constexpr, BLOCK_B: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
               PRE: tl.constexpr, D: tl.constexpr, LN_BLOCK: tl.constexpr,
               ALIGNED: tl.constexpr, ACQ: tl.constexpr, tr_ptr, TRACE: tl.constexpr, npf,
               RPF: tl.constexpr, EARLY: tl.constexpr):
    """Rows [n0, n1) as ONE loop over (row block, K tile) steps, software-pipelined by Triton
    (tl.range num_stages: STAGES - 1 weight tiles in flight through shared memory by
    cp.async, across row-block boundaries: no pipeline drain per block). Each block's
    products are added in K order (tl.dot: [BLOCK_B, BK] x [BK, BN]; FMA (b=1): into
    [BN, BK], summed at the end), then its epilogue.
    PRE: the instruction's waits and LayerNorm (_wait_ln) run inside step 0, after its
    weight load, and step 0's activations are loaded there. The pipeliner's prologue (the
    first STAGES - 1 steps' weight tiles, cp.async, just before the loop) is then issued
    before the poll loop, so their HBM latency overlaps the wait (weights never change
    during a step); step STAGES - 1's tile follows in iteration 0, after the wait (it
    reuses step 0's buffer). Otherwise the same loop: the same products in the same order,
    the same epilogues, the same bits. The compiler never emits an empty tile
    (n_steps >= 1), so step 0 always runs.
    EARLY: a block's bias (and EPI 2's residual rows) loaded at its first step (after the
    instruction's waits) instead of in its epilogue, so the epilogue adds and stores with no
    L2 round trip on the loop's chain. The residual's columns [n0, n1) are written by this
    instruction alone in its layer, in its epilogue, and hold their final value once its
    first wait is met (the previous layer's W2 wrote them; acquired through attention -> qkv
    -> that W2): the same values, the same bits."""
    KT: tl.constexpr = K // BK
    n_steps = ((n1 - n0 + BN - 1) // BN) * KT
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < B
    x_rows = x_ptr + offs_b[:, None] * stride_x
    k0 = tl.arange(0, BK)
    if DOT:
        acc = tl.zeros([BLOCK_B, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    if PRE:      # (step 0 loads it, after the wait)
        xk = tl.zeros([BLOCK_B, BK], dtype=x_ptr.dtype.element_ty)
    else:
        xk = tl.load(x_rows + k0[None, :], mask=b_ok[:, None], other=0.0,
                     cache_modifier=".cg")
    eb = tl.zeros([BN], dtype=tl.float32)           # EARLY: the block's bias, residual
    er = tl.zeros([BLOCK_B, BN], dtype=tl.float32)
    for s in tl.range(0, n_steps, num_stages=STAGES):
        blk = s // KT
        kk = (s - blk * KT) * BK
        offs_n = n0 + blk * BN + tl.arange(0, BN)
        n_ok = offs_n < n1
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + kk + k0[None, :],
                    mask=n_ok[:, None], other=0.0)
        if PRE:
            if s == 0:
                _wait_ln(cnt_ptr, wb, fb, a_off, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
                         B, D, LN_BLOCK, ALIGNED, ACQ, True, tr_ptr, TRACE, npf, RPF)
                xk = tl.load(x_rows + k0[None, :], mask=b_ok[:, None], other=0.0,
                             cache_modifier=".cg")
        if EARLY:
            if kk == 0:
                eb, er = _epilogue_operands(offs_b, b_ok, offs_n, n_ok, bias_ptr, y_ptr,
                                            stride_y, EPI)
        # the next step's activations (L2) are loaded before this step's products: their
        # latency is not on the per-step chain
        kn = ((s + 1) % KT) * BK
        xn = tl.load(x_rows + kn + k0[None, :], mask=b_ok[:, None], other=0.0,
                     cache_modifier=".cg")
        acc = _mac_x(acc, w, xk, DOT)
        xk = xn
        if kk == K - BK:
            if DOT:
                _epilogue(acc, offs_b, b_ok, offs_n, n_ok, bias_ptr, y_ptr, stride_y, n_split,
                          gap, EPI, EARLY, eb, er)
                acc = tl.zeros([BLOCK_B, BN], dtype=tl.float32)
            else:
                _epilogue(tl.sum(acc, axis=1)[None, :], offs_b, b_ok, offs_n, n_ok, bias_ptr,
                          y_ptr, stride_y, n_split, gap, EPI, EARLY, eb, er)
                acc = tl.zeros([BN, BK], dtype=tl.float32)


@triton.jit
def _gemv_prefetch(w_ptr, n0, n1, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   UNROLL: tl.constexpr):
    """The first K group (UNROLL tiles of [BN, BK]) of the tile's first block: loaded before
    the instruction waits for its inputs (weights never change during a step)."""
    offs_n = n0 + tl.arange(0, BN)
    n_ok = offs_n < n1
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    k0 = tl.arange(0, BK)
    w0 = tl.load(w_rows + k0[None, :], mask=n_ok[:, None], other=0.0)
    w1 = w0
    w2 = w0
    w3 = w0
    if UNROLL >= 2:
        w1 = tl.load(w_rows + BK + k0[None, :], mask=n_ok[:, None], other=0.0)
    if UNROLL == 4:
        w2 = tl.load(w_rows + 2 * BK + k0[None, :], mask=n_ok[:, None], other=0.0)
        w3 = tl.load(w_rows + 3 * BK + k0[None, :], mask=n_ok[:, None], other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _mac(acc, w, x_rows, k0, b_ok, DOT: tl.constexpr):
    """acc += the products of one [BN, BK] weight tile with the activations at k0."""
    x = tl.load(x_rows + k0[None, :], mask=b_ok[:, None], other=0.0, cache_modifier=".cg")
    return _mac_x(acc, w, x, DOT)


@triton.jit
def _mac_x(acc, w, x, DOT: tl.constexpr):
    """acc += the products of one [BN, BK] weight tile with the activation tile x."""
    if DOT:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _gemv_block(x_rows, b_ok, w_ptr, bias_ptr, y_ptr, nb, n1, n_split, gap, stride_y,
                p0, p1, p2, p3,
                K: tl.constexpr, EPI: tl.constexpr, BLOCK_B: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                STAGES: tl.constexpr, UNROLL: tl.constexpr, PRE: tl.constexpr):
    """Rows [nb, nb + BN) of y = x W^T (+ epilogue), K in groups of UNROLL tiles of BK (1, 2,
    4; divides K / BK): a group's tiles are all loaded before the first is used (more bytes
    in flight per SM where Triton does not pipeline the loop). PRE: the first group is
    p0..p3 (prefetched by _gemv_prefetch). The products are added in the same order for
    every UNROLL and PRE, so the result is the same bits."""
    offs_n = nb + tl.arange(0, BN)
    n_ok = offs_n < n1
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    k0 = tl.arange(0, BK)
    offs_b = tl.arange(0, BLOCK_B)
    if DOT:
        acc = tl.zeros([BLOCK_B, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    k_first = BK * UNROLL if PRE else 0
    if PRE:
        acc = _mac(acc, p0, x_rows, k0, b_ok, DOT)
        if UNROLL >= 2:
            acc = _mac(acc, p1, x_rows, BK + k0, b_ok, DOT)
        if UNROLL == 4:
            acc = _mac(acc, p2, x_rows, 2 * BK + k0, b_ok, DOT)
            acc = _mac(acc, p3, x_rows, 3 * BK + k0, b_ok, DOT)
    if UNROLL == 1:
        for kk in tl.range(k_first, K, BK, num_stages=STAGES):
            w = tl.load(w_rows + kk + k0[None, :], mask=n_ok[:, None], other=0.0)
            acc = _mac(acc, w, x_rows, kk + k0, b_ok, DOT)
    else:
        for kk in range(k_first, K, BK * UNROLL):
            w0 = tl.load(w_rows + kk + k0[None, :], mask=n_ok[:, None], other=0.0)
            w1 = tl.load(w_rows + kk + BK + k0[None, :], mask=n_ok[:, None], other=0.0)
            if UNROLL == 4:
                w2 = tl.load(w_rows + kk + 2 * BK + k0[None, :], mask=n_ok[:, None],
                             other=0.0)
                w3 = tl.load(w_rows + kk + 3 * BK + k0[None, :], mask=n_ok[:, None],
                             other=0.0)
            acc = _mac(acc, w0, x_rows, kk + k0, b_ok, DOT)
            acc = _mac(acc, w1, x_rows, kk + BK + k0, b_ok, DOT)
            if UNROLL == 4:
                acc = _mac(acc, w2, x_rows, kk + 2 * BK + k0, b_ok, DOT)
                acc = _mac(acc, w3, x_rows, kk + 3 * BK + k0, b_ok, DOT)
    if not DOT:
        acc = tl.sum(acc, axis=1)[None, :]
    _epilogue(acc, offs_b, b_ok, offs_n, n_ok, bias_ptr, y_ptr, stride_y, n_split, gap, EPI)


@triton.jit
def _epilogue_operands(offs_b, b_ok, offs_n, n_ok, bias_ptr, y_ptr, stride_y,
                       EPI: tl.constexpr):
    """What a block's epilogue reads: its bias (fp32) and, for EPI 2, the residual rows it
    adds to (zeros otherwise)."""
    bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if EPI == 2:
        res = tl.load(y_ptr + offs_b[:, None] * stride_y + offs_n[None, :],
                      mask=b_ok[:, None] & n_ok[None, :], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
    else:
        res = tl.zeros([offs_b.shape[0], offs_n.shape[0]], dtype=tl.float32)
    return bias, res


@triton.jit
def _epilogue(acc, offs_b, b_ok, offs_n, n_ok, bias_ptr, y_ptr, stride_y, n_split, gap,
              EPI: tl.constexpr, EARLY: tl.constexpr = False, eb=None, er=None):
    """acc [BLOCK_B, BN] (fp32) + bias -> y by the epilogue (gemv.py's EPI). EARLY: the bias
    and EPI 2's residual rows are eb / er, loaded at the block's start (_epilogue_operands)."""
    mask = b_ok[:, None] & n_ok[None, :]
    if EARLY:
        bias = eb
    else:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc += bias[None, :]
    if EPI == 2:
        ptrs = y_ptr + offs_b[:, None] * stride_y + offs_n[None, :]
        if EARLY:
            tl.store(ptrs, er + acc, mask=mask)
        else:
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg") + acc,
                     mask=mask)
    else:
        col = offs_n[None, :]
        val = acc
        if EPI == 1:
            t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            u = 0.7978845608028654 * (t + 0.044715 * t * t * t)
            g = t / (1.0 + tl.exp(-2.0 * u))
            hi = col >= n_split
            val = tl.where(hi, g, t)
            col = col + tl.where(hi, gap, 0)
        stored = val.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_b[:, None] * stride_y + col, stored, mask=mask)


@triton.jit
def _load_group(w_ptr, s, n_steps, n0, n1, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, UNROLL: tl.constexpr):
    """Step s of a streamed tile: block s // KG, K group s % KG (UNROLL tiles of [BN, BK]);
    s >= n_steps loads nothing (all masked)."""
    KG = K // (BK * UNROLL)
    offs_n = n0 + (s // KG) * BN + tl.arange(0, BN)
    ok = ((offs_n < n1) & ((offs_n * 0 + s) < n_steps))[:, None]
    rows = w_ptr + offs_n[:, None].to(tl.int64) * K + (s % KG) * (BK * UNROLL)
    k0 = tl.arange(0, BK)[None, :]
    w0 = tl.load(rows + k0, mask=ok, other=0.0)
    w1 = w0
    w2 = w0
    w3 = w0
    if UNROLL >= 2:
        w1 = tl.load(rows + BK + k0, mask=ok, other=0.0)
    if UNROLL == 4:
        w2 = tl.load(rows + 2 * BK + k0, mask=ok, other=0.0)
        w3 = tl.load(rows + 3 * BK + k0, mask=ok, other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _gemv_stream(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_y,
                 c0, c1, c2, c3,
                 K: tl.constexpr, EPI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 UNROLL: tl.constexpr):
    """b=1, FMA: rows [n0, n1) as one stream of steps (block, K group of UNROLL tiles),
    double-buffered in registers: step s + 1's weights are loaded before step s is
    computed, so a group is always in flight. c0..c3: step 0's group, prefetched before the
    instruction waited. Per block the products are added in K order into [BN, BK] and
    summed at the end (the fused FMA GEMV's order)."""
    KG = K // (BK * UNROLL)
    n_steps = ((n1 - n0 + BN - 1) // BN) * KG
    k0 = tl.arange(0, BK)
    offs_b = tl.arange(0, 1)
    b_ok = offs_b < 1
    x_rows = x_ptr + offs_b[:, None] * 0
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for s in range(0, n_steps):
        d0, d1, d2, d3 = _load_group(w_ptr, s + 1, n_steps, n0, n1, K, BN, BK, UNROLL)
        kb = (s % KG) * (BK * UNROLL)
        acc = _mac(acc, c0, x_rows, kb + k0, b_ok, False)
        if UNROLL >= 2:
            acc = _mac(acc, c1, x_rows, kb + BK + k0, b_ok, False)
        if UNROLL == 4:
            acc = _mac(acc, c2, x_rows, kb + 2 * BK + k0, b_ok, False)
            acc = _mac(acc, c3, x_rows, kb + 3 * BK + k0, b_ok, False)
        if s % KG == KG - 1:
            offs_n = n0 + (s // KG) * BN + tl.arange(0, BN)
            _epilogue(tl.sum(acc, axis=1)[None, :], offs_b, b_ok, offs_n, offs_n < n1,
                      bias_ptr, y_ptr, stride_y, n_split, gap, EPI)
            acc = tl.zeros([BN, BK], dtype=tl.float32)
        c0, c1, c2, c3 = d0, d1, d2, d3


@triton.jit
def _gemv_tile(x_ptr, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_x, stride_y,
               p0, p1, p2, p3,
               B: tl.constexpr, K: tl.constexpr, EPI: tl.constexpr, BLOCK_B: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, UNROLL: tl.constexpr):
    """Rows [n0, n1) (whole BN blocks but the last): the first block with the prefetched
    group p0..p3, then the others."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < B
    x_rows = x_ptr + offs_b[:, None] * stride_x
    _gemv_block(x_rows, b_ok, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_y,
                p0, p1, p2, p3, K, EPI, BLOCK_B, BN, BK, DOT, STAGES, UNROLL, True)
    for nb in range(n0 + BN, n1, BN):
        _gemv_block(x_rows, b_ok, w_ptr, bias_ptr, y_ptr, nb, n1, n_split, gap, stride_y,
                    p0, p1, p2, p3, K, EPI, BLOCK_B, BN, BK, DOT, STAGES, UNROLL, False)


@triton.jit
def _gemv_op(cnt_ptr, wb, fb, a_off, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap,
             stride_x, stride_y, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
             B: tl.constexpr, D: tl.constexpr, K: tl.constexpr, EPI: tl.constexpr,
             BLOCK_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
             STAGES: tl.constexpr, UNROLL: tl.constexpr, LN_BLOCK: tl.constexpr,
             PIPE: tl.constexpr, ALIGNED: tl.constexpr, ACQ: tl.constexpr,
             PRE: tl.constexpr, tr_ptr, TRACE: tl.constexpr, npf,
             RPF: tl.constexpr, EARLY: tl.constexpr):
    """One GEMV instruction: prefetch its first weights (not PIPE: the first group into
    registers), wait for its inputs, the fused LayerNorm of the bucket's rows into this
    program's scratch (_wait_ln), then the tile (PIPE: _gemv_pipe; else b=1 FMA:
    _gemv_stream, else _gemv_tile). PIPE and PRE: _gemv_pipe
    waits inside its first step, after the pipeliner has issued the first weight tiles.
    Fields 11..19 come as wi0..f19 (read with the others at the instruction's start).
    TRACE: inputs ready, LayerNorm done (_wait_ln) and the tile's last epilogue done into
    tr_ptr[1..3] (the instruction's trace row)."""
    if PIPE:
        p0 = 0
        p1 = 0
        p2 = 0
        p3 = 0
    elif (not DOT) and B == 1:
        p0, p1, p2, p3 = _load_group(w_ptr, 0, 1, n0, n1, K, BN, BK, UNROLL)
    else:
        p0, p1, p2, p3 = _gemv_prefetch(w_ptr, n0, n1, K, BN, BK, UNROLL)
    if not (PIPE and PRE):
        _wait_ln(cnt_ptr, wb, fb, a_off, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
                 B, D, LN_BLOCK, ALIGNED, ACQ, False, tr_ptr, TRACE, npf, RPF)
    if PIPE:
        _gemv_pipe(wb + a_off, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_x,
                   stride_y, cnt_ptr, wb, fb, a_off, eps, wi0, wt0, wi1, wt1, f16, f17, f18,
                   f19, B, K, EPI, BLOCK_B, BN, BK, DOT, STAGES, PRE, D, LN_BLOCK, ALIGNED,
                   ACQ, tr_ptr, TRACE, npf, RPF, EARLY)
    elif (not DOT) and B == 1:
        _gemv_stream(wb + a_off, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_y,
                     p0, p1, p2, p3, K, EPI, BN, BK, UNROLL)
    else:
        _gemv_tile(wb + a_off, w_ptr, bias_ptr, y_ptr, n0, n1, n_split, gap, stride_x,
                   stride_y, p0, p1, p2, p3, B, K, EPI, BLOCK_B, BN, BK, DOT, STAGES, UNROLL)
    if TRACE:
        tl.store(tr_ptr + 3, _globaltimer())


@triton.jit
def _ln_rows(x_ptr, g_ptr, b_ptr, y_ptr, eps, B: tl.constexpr, D: tl.constexpr,
             BLOCK: tl.constexpr):
    """LayerNorm of rows [0, B) of x into y (layernorm.py's per-row math, fp32 statistics);
    gamma / beta loaded once, row r + 1 loaded before row r's reductions (its L2 latency off
    the chain)."""
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    w = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    xn = tl.load(x_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    for r in range(B):
        x = xn
        xn = tl.load(x_ptr + tl.minimum(r + 1, B - 1) * D + offs, mask=ok, other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(ok, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(y_ptr + r * D + offs, (xc * rstd * w + b).to(y_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _rope_cs(cos_ptr, sin_ptr, ti, HD: tl.constexpr, HALF: tl.constexpr):
    """decode_attention's rotary sources and factors at table row ti: output d takes
    x[src_c] * c + x[src_s] * s."""
    return rotary_sources(tl.arange(0, HD), cos_ptr, sin_ptr, ti, HALF)


@triton.jit
def _attn_op(cnt_ptr, hc_base, qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
             m_ptr, l_ptr, acc_ptr, out_ptr, row, h, s0, s1, n_sub, scale,
             wi0, wt0, wi1, wt1, f16,
             B: tl.constexpr, SU: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
             HD: tl.constexpr,
             HALF: tl.constexpr, CAP: tl.constexpr, N_TABLE: tl.constexpr,
             CHUNK: tl.constexpr, NSPLIT: tl.constexpr,
             S_ROW: tl.constexpr, S_HEAD: tl.constexpr, S_POS: tl.constexpr,
             STAGES: tl.constexpr, ACQ: tl.constexpr, npf, RPF: tl.constexpr):
    """Key splits [s0, s1) of one (row, head): ops/decode_attention.py's attend_partial for
    each split (rotary, the new k/v written by the split that holds the row's position, the
    split's softmax partials into the scratch), one split after another; the first split's
    cached keys / values are loaded before waiting for q/k/v (the cache below the row's
    position does not change during a step; the position changes only in the step's
    advance, after every attention). The last of the n_sub instructions of this (row, head)
    to finish merges the splits into out (decode_attention._merge)."""
    kvh = h // (NH // NKV)
    pos = tl.load(pos_ptr + row, cache_modifier=".cg")
    pw = tl.minimum(pos, CAP - 1)
    ti = tl.minimum(pos, N_TABLE - 1)
    d = tl.arange(0, HD)
    cache_off = row * S_ROW + kvh * S_HEAD
    _attn_splits(cnt_ptr, qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr,
                 row, h, kvh, s0, s1, pw, ti, d, cache_off, scale, wi0, wt0, wi1, wt1, B, SU,
                 NH, NKV, HD, HALF, CHUNK, NSPLIT, S_POS, STAGES, ACQ)
    tl.debug_barrier()
    done = n_sub - 1
    if n_sub > 1:     # release our partials, acquire the others'
        layer = f16.to(tl.int32)
        done = tl.atomic_add(cnt_ptr + hc_base + (layer * B + row) * NH + h, 1,
                             sem="acq_rel", scope="gpu")
    if done == n_sub - 1:     # (in split order: the fused deterministic step's bits)
        _merge(m_ptr, l_ptr, acc_ptr, out_ptr, SU, row, h, NH, HD, NSPLIT, NSPLIT,
               ORDERED=True)
    _l1_prefetch_record(npf, RPF)     # (after the merge counter's acquire)


@triton.jit
def _attn_splits(cnt_ptr, qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, m_ptr, l_ptr, acc_ptr,
                 row, h, kvh, s0, s1, pw, ti, d, cache_off, scale, wi0, wt0, wi1, wt1,
                 B: tl.constexpr, SU: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
                 HD: tl.constexpr, HALF: tl.constexpr, CHUNK: tl.constexpr,
                 NSPLIT: tl.constexpr, S_POS: tl.constexpr, STAGES: tl.constexpr,
                 ACQ: tl.constexpr):
    """_attn_op's splits [s0, s1) one after another: the first split's keys / values loaded
    before the wait, q / the new k, v after it, each split's partials into the scratch."""
    kt, vt = _attn_kv(kc_ptr, vc_ptr, cache_off, s0, pw, d, CHUNK, S_POS)
    _waits(cnt_ptr, wi0, wt0, wi1, wt1, ACQ)
    src_c, src_s, c, s = _rope_cs(cos_ptr, sin_ptr, ti, HD, HALF)
    q, k_new, v_new, sc_new = _attn_new(qkv_ptr, kc_ptr, vc_ptr, cache_off, row, h, kvh,
                                        pw, s0, s1, d, src_c, src_s, c, s, scale, SU, NH,
                                        NKV, HD, CHUNK, S_POS)
    split_partials(scores(kt, q, scale), vt, v_new, sc_new, s0, pw, m_ptr, l_ptr, acc_ptr,
                   row, h, NH, HD, CHUNK, NSPLIT)
    for sp in tl.range(s0 + 1, s1, num_stages=STAGES if B > 1 else 1):
        kt, vt = _attn_kv(kc_ptr, vc_ptr, cache_off, sp, pw, d, CHUNK, S_POS)
        split_partials(scores(kt, q, scale), vt, v_new, sc_new, sp, pw, m_ptr, l_ptr,
                       acc_ptr, row, h, NH, HD, CHUNK, NSPLIT)


@triton.jit
def _attn_kv(kc_ptr, vc_ptr, cache_off, sp, pw, d, CHUNK: tl.constexpr, S_POS: tl.constexpr):
    """Split sp's cached keys / values below the position pw (the rest masked to 0)."""
    j = sp * CHUNK + tl.arange(0, CHUNK)
    kt = tl.load(kc_ptr + cache_off + j[:, None] * S_POS + d[None, :],
                 mask=(j < pw)[:, None], other=0.0, cache_modifier=".cg")
    vt = tl.load(vc_ptr + cache_off + j[:, None] * S_POS + d[None, :],
                 mask=(j < pw)[:, None], other=0.0, cache_modifier=".cg")
    return kt, vt


@triton.jit
def _attn_new(qkv_ptr, kc_ptr, vc_ptr, cache_off, row, h, kvh, pw, s0, s1, d, src_c, src_s,
              c, s, scale, SU: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
              HD: tl.constexpr, CHUNK: tl.constexpr, S_POS: tl.constexpr):
    """After the wait: the row's rotated q and new k (rounded to the cache dtype), its v;
    the new k/v written at pw by the instruction whose splits hold it (one per k/v head);
    the new key's score. Returns q (fp32), k_new, v_new, sc_new."""
    base = qkv_ptr + row * SU
    q_off = h * HD
    k_off = NH * HD + kvh * HD
    v_off = (NH + NKV) * HD + kvh * HD
    q = tl.load(base + q_off + src_c, cache_modifier=".cg").to(tl.float32) * c \
        + tl.load(base + q_off + src_s, cache_modifier=".cg").to(tl.float32) * s
    k_new = tl.load(base + k_off + src_c, cache_modifier=".cg").to(tl.float32) * c \
        + tl.load(base + k_off + src_s, cache_modifier=".cg").to(tl.float32) * s
    v_new = tl.load(base + v_off + d, cache_modifier=".cg")
    q = q.to(kc_ptr.dtype.element_ty).to(tl.float32)
    k_new = k_new.to(kc_ptr.dtype.element_ty)
    if (pw >= s0 * CHUNK) & (pw < s1 * CHUNK) & (h % (NH // NKV) == 0):
        tl.store(kc_ptr + cache_off + pw * S_POS + d, k_new)
        tl.store(vc_ptr + cache_off + pw * S_POS + d, v_new.to(vc_ptr.dtype.element_ty))
    sc_new = tl.sum(k_new.to(tl.float32) * q, axis=0) * scale
    return q, k_new, v_new, sc_new


@triton.jit
def _advance_row(x_ptr, h_ptr, active_ptr, pos_ptr, phase_ptr, kind_ptr, table_ptr,
                 first_ptr, row, NK: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """ops/row_advance.py for one row (every channel block)."""
    act = tl.load(active_ptr + row, cache_modifier=".cg")
    if act != 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(h_ptr + row * D + offs, x.to(h_ptr.dtype.element_ty), mask=ok)
        tl.store(pos_ptr + row, tl.load(pos_ptr + row, cache_modifier=".cg") + 1)
        ph = tl.load(phase_ptr + row, cache_modifier=".cg")
        kind = tl.load(kind_ptr + row, cache_modifier=".cg")
        tl.store(phase_ptr + row, tl.load(table_ptr + ph * NK + kind))
        tl.store(first_ptr + row, tl.zeros([], dtype=tl.uint8))


@triton.jit
def _argmax_row(x_ptr, out_ptr, phase_ptr, first_ptr, mask_col, row,
                V: tl.constexpr, LS: tl.constexpr, OUT_COL: tl.constexpr,
                BLOCK: tl.constexpr):
    """ops/masked_argmax.py for one row (the answer-marker rule)."""
    base = x_ptr + row * LS
    drop = (tl.load(phase_ptr + row, cache_modifier=".cg") == 0) & \
        (tl.load(first_ptr + row, cache_modifier=".cg") == 0)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(base + offs, mask=offs < V, other=float("-inf"),
                    cache_modifier=".cg").to(tl.float32)
        v = tl.where((offs == mask_col) & drop, float("-inf"), v)
        m = tl.max(v, axis=0)
        i = tl.argmax(v, axis=0).to(tl.int64) + start
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row * 4 + OUT_COL, best_i)


@triton.jit
def read_record(rec):
    """The 20 int64 fields of one instruction (instructions.py's layout), all loaded at once:
    one round trip, not one per use (op, the four operand offsets, the tile (int32), p0..p3,
    the two waits (int32), the signal, p4..p7)."""
    return (tl.load(rec + 0), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3),
            tl.load(rec + 4), tl.load(rec + 5).to(tl.int32), tl.load(rec + 6).to(tl.int32),
            tl.load(rec + 7), tl.load(rec + 8), tl.load(rec + 9), tl.load(rec + 10),
            tl.load(rec + 11).to(tl.int32), tl.load(rec + 12).to(tl.int32),
            tl.load(rec + 13).to(tl.int32), tl.load(rec + 14).to(tl.int32), tl.load(rec + 15),
            tl.load(rec + 16), tl.load(rec + 17), tl.load(rec + 18), tl.load(rec + 19))


@triton.jit
def finish_launch(cnt_ptr, n_cnt, n_prog):
    """A program past its queue counts itself; the last one zeroes every counter for the
    next launch."""
    done = tl.atomic_add(cnt_ptr + n_cnt - 1, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:
        for c0 in range(0, n_cnt, 128):
            offs = c0 + tl.arange(0, 128)
            tl.store(cnt_ptr + offs, tl.zeros([128], dtype=tl.int32), mask=offs < n_cnt)


@triton.jit
def megakernel(table_ptr, queue_ptr, cnt_ptr, wb, fb, ib, ub,
               cos_off, sin_off, m_off, l_off, acc_off, n_prog, n_cnt, hc_base, eps, scale,
               trace_ptr, stop_ptr, act_ptr,
               B: tl.constexpr, D: tl.constexpr, SU: tl.constexpr, KW2: tl.constexpr,
               V: tl.constexpr, LS: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
               HD: tl.constexpr, HALF: tl.constexpr, CAP: tl.constexpr,
               N_TABLE: tl.constexpr, CHUNK: tl.constexpr, NSPLIT: tl.constexpr,
               S_ROW: tl.constexpr, S_HEAD: tl.constexpr,
               S_POS: tl.constexpr, NK: tl.constexpr, OUT_COL: tl.constexpr,
               W1_BB: tl.constexpr, W1_BN: tl.constexpr, W1_BK: tl.constexpr,
               W1_DOT: tl.constexpr, W1_UN: tl.constexpr,
               W2_BB: tl.constexpr, W2_BN: tl.constexpr, W2_BK: tl.constexpr,
               W2_DOT: tl.constexpr, W2_UN: tl.constexpr,
               LM_BB: tl.constexpr, LM_BN: tl.constexpr, LM_BK: tl.constexpr,
               LM_DOT: tl.constexpr, LM_UN: tl.constexpr,
               LN_BLOCK: tl.constexpr, ARG_BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
               STAGES: tl.constexpr, PIPE: tl.constexpr, ACQ: tl.constexpr, PRE: tl.constexpr,
               TRACE: tl.constexpr, SKIP: tl.constexpr = False,
               B_P2: tl.constexpr = 1, RPF: tl.constexpr = False,
               EARLY: tl.constexpr = False):
    pid = tl.program_id(0)
    q0 = tl.load(queue_ptr + pid)
    q1 = tl.load(queue_ptr + pid + 1)
    if SKIP:    # every active row stopped (ops/row_stop.py): no work; the counters stay
        r = tl.arange(0, B_P2)
        act = tl.load(act_ptr + r, mask=r < B, other=0).to(tl.int32)
        live = act * (tl.load(stop_ptr + r, mask=r < B, other=1) == 0).to(tl.int32)
        q1 = tl.where((tl.sum(act, axis=0) > 0) & (tl.sum(live, axis=0) == 0), q0, q1)
    for i in range(q0, q1):
        tr = trace_ptr + 5 * i
        if TRACE:        # instruction i's row of 5 ns times: start, (GEMVs: inputs ready,
            #              LayerNorm done, tile done), end - bench/trace_megakernel.py
            tl.store(tr, _globaltimer())
        rec = table_ptr + i * _STRIDE
        (op, a_off, w_off, b_off, y_off, n0, n1, p0, p1, p2, p3, wi0, wt0, wi1, wt1, sig, f16,
         f17, f18, f19) = read_record(rec)
        # (every field read here at once: one round trip, not one per use; on CUDA the
        # record two ahead goes to L2 now)
        if ACQ:
            if i + 2 < q1:
                _prefetch_record(rec + 2 * _STRIDE, False)
        # (RPF: the next record into L1 once this instruction's acquires are done; the
        # last instruction of a queue prefetches its own again)
        npf = rec + tl.where(i + 1 < q1, _STRIDE, 0)
        if op <= 3:      # GEMV / attention: 16-element aligned operands (vector loads);
            # (hinted inside the branch: a value merged from two branches loses the hint)
            a_al = _aligned(a_off, ALIGNED)
            w_al = _aligned(w_off, ALIGNED)
            b_al = _aligned(b_off, ALIGNED)
            y_al = _aligned(y_off, ALIGNED)
            if op == 0:      # OP_GEMV_W1 (LayerNorm of x fused)
                _gemv_op(cnt_ptr, wb, fb, a_al, wb + w_al, wb + b_al, wb + y_al, n0, n1,
                         p0.to(tl.int32), p1.to(tl.int32), D, SU, eps,
                         wi0, wt0, wi1, wt1, f16, f17, f18, f19, B, D, D, 1, W1_BB, W1_BN,
                         W1_BK, W1_DOT, STAGES, W1_UN, LN_BLOCK, PIPE, ALIGNED,
                         ACQ, PRE, tr, TRACE, npf, RPF, EARLY)
            elif op == 1:    # OP_GEMV_W2 (bias and residual in fp32)
                _gemv_op(cnt_ptr, wb, fb, a_al, wb + w_al, fb + b_al, fb + y_al, n0, n1,
                         0, 0, SU, D, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
                         B, D, KW2, 2, W2_BB, W2_BN, W2_BK, W2_DOT, STAGES,
                         W2_UN, LN_BLOCK, PIPE, ALIGNED, ACQ, PRE,
                         tr, TRACE, npf, RPF, EARLY)
            elif op == 2:    # OP_GEMV_LM (LayerNorm of hidden fused)
                _gemv_op(cnt_ptr, wb, fb, a_al, wb + w_al, wb + b_al, wb + y_al, n0, n1,
                         0, 0, D, LS, eps, wi0, wt0, wi1, wt1, f16, f17, f18, f19,
                         B, D, D, 0, LM_BB, LM_BN, LM_BK, LM_DOT, STAGES,
                         LM_UN, LN_BLOCK, PIPE, ALIGNED, ACQ, PRE,
                         tr, TRACE, npf, RPF, EARLY)
            elif op == 3:    # OP_ATTN: tile = (row, head), splits [p1, p2) of p3 instructions
                _attn_op(cnt_ptr, hc_base, wb + a_al, ib + p0, fb + cos_off, fb + sin_off,
                         wb + w_al, wb + b_al, fb + m_off, fb + l_off, fb + acc_off, wb + y_al,
                         n0, n1, p1.to(tl.int32), p2.to(tl.int32), p3.to(tl.int32), scale,
                         wi0, wt0, wi1, wt1, f16, B, SU,
                         NH, NKV, HD, HALF, CAP, N_TABLE, CHUNK, NSPLIT, S_ROW, S_HEAD,
                         S_POS, STAGES, ACQ, npf, RPF)
        else:
            _waits(cnt_ptr, wi0, wt0, wi1, wt1, ACQ)
            _l1_prefetch_record(npf, RPF)
            if op == 4:    # OP_ADVANCE
                _advance_row(fb + a_off, wb + y_off, ub + w_off, ib + p0, ib + p1, ib + p2,
                             ib + p3, ub + b_off, n0, NK, D, LN_BLOCK)
            else:          # OP_ARGMAX
                _argmax_row(wb + a_off, ib + y_off, ib + p0, ub + p1, p2, n0, V, LS,
                            OUT_COL, ARG_BLOCK)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + sig, 1, sem="release", scope="gpu")
        if TRACE:
            tl.store(tr + 4, _globaltimer())
    finish_launch(cnt_ptr, n_cnt, n_prog)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unroll_for(k: int, block_k: int, want: int) -> int:
    """The largest of want, 2, 1 (powers of two <= 4) that divides the K loop's trip count."""
    trips = k // block_k
    for u in (4, 2, 1):
        if u <= want and trips % u == 0:
            return u
    return 1


# GEMV W-tile unroll when none is given (1: the plain loop, tl.range pipelined where Triton
# does it; 2 / 4: that many W tiles loaded before the first is used); MegakernelStep picks
# per bucket (megakernel_step.py)
UNROLL = 4


def constexprs(sh: dict, gemv_cfg: dict, aligned: bool, unroll: int | None = None,
               pipe: bool = False, pre: bool = False, trace: bool = False, rpf: bool = False,
               early: bool = False, poll1: bool = False) -> dict:
    """The megakernel's constexprs for a lowering's shapes and GEMV configs (also used to
    compile it ahead of time without a GPU: bench/compile_megakernel.py). pipe: GEMVs as
    _gemv_pipe; pre (pipe only): a GEMV instruction waits inside its pipelined loop's first
    step, its first weight tiles already issued; trace (CUDA only: inline PTX): each
    instruction's start / end on the global timer."""
    from .instructions import OP_GEMV_LM, OP_GEMV_W1, OP_GEMV_W2

    unroll = UNROLL if unroll is None else unroll
    kw = {k: sh[k] for k in ("B", "D", "SU", "KW2", "V", "LS", "NH", "NKV", "HD", "HALF",
                             "CAP", "N_TABLE", "CHUNK", "NSPLIT", "S_ROW", "S_HEAD", "S_POS",
                             "NK", "OUT_COL")}
    for name, op, k in (("W1", OP_GEMV_W1, sh["D"]), ("W2", OP_GEMV_W2, sh["KW2"]),
                        ("LM", OP_GEMV_LM, sh["D"])):
        g = gemv_cfg[op]
        kw.update({f"{name}_BB": 16 if g.dot else 1, f"{name}_BN": g.block_n,
                   f"{name}_BK": g.block_k, f"{name}_DOT": g.dot,
                   f"{name}_UN": unroll_for(k, g.block_k, unroll)})
    kw["LN_BLOCK"] = triton.next_power_of_2(sh["D"])
    kw["ARG_BLOCK"] = min(4096, triton.next_power_of_2(sh["V"]))
    kw["ALIGNED"] = bool(aligned)
    kw["PIPE"] = bool(pipe)
    # acquire-load polls (2: by one thread, poll1), record prefetch (inline PTX)
    kw["ACQ"] = 0 if interpreted() else (2 if poll1 else 1)
    kw["PRE"] = bool(pre) and bool(pipe)
    kw["TRACE"] = bool(trace) and not interpreted()
    kw["RPF"] = bool(rpf) and not interpreted()     # (inline PTX)
    kw["EARLY"] = bool(early) and bool(pipe)        # (_gemv_pipe's)
    return kw


def kernel_args(c, low, unroll: int | None = None, align: bool = True, pre: bool = False,
                trace=None, skip=None, rpf: bool = False, early: bool = False,
                poll1: bool = False) -> tuple[tuple, dict]:
    """Positional args and constexprs of megakernel for a Compiled c and its lowering
    (align=False: no alignment hints even where the table allows them: 2-byte loads, the
    build measured in session 3; trace: an int64 tensor [n_instr, 5] for the instructions'
    ns times (start, a GEMV's inputs ready / LayerNorm done / tile done, end), None: no
    trace; skip: (stopped int32 [rows], active bool [rows]) - every program skips its queue
    when every active row of the bucket has stopped, None: never)."""
    off = c.offsets
    stop, act = skip if skip is not None else (c.counters, c.counters)
    args = (c.table, c.queue, c.counters, c.bases["w"], c.bases["f"], c.bases["i"],
            c.bases["u"], off["cos"], off["sin"], off["sc_m"], off["sc_l"], off["sc_acc"],
            c.n_programs, c.counters.numel(), len(c.ops) * CNT_STRIDE, 1e-5,
            low.shape["HD"] ** -0.5, c.table if trace is None else trace, stop, act)
    kw = constexprs(low.shape, low.gemv_cfg, c.aligned and align, unroll,
                    getattr(low, "pipe", False), pre=pre, trace=trace is not None, rpf=rpf,
                    early=early, poll1=poll1)
    if skip is not None:
        kw["SKIP"] = True
        kw["B_P2"] = triton.next_power_of_2(low.shape["B"])
    return args, kw


# warps / pipelining depth of the megakernel (one value for every op: its registers are the
# maximum over all ops); PHOTON_MK_WARPS / PHOTON_MK_STAGES override (bench sweeps)
NUM_WARPS = int(os.environ.get("PHOTON_MK_WARPS", "8"))
NUM_STAGES = int(os.environ.get("PHOTON_MK_STAGES", "3"))


def launch(c, low, num_warps: int | None = None, num_stages: int | None = None,
           unroll: int | None = None, align: bool = True, pre: bool = False, trace=None,
           skip=None, rpf: bool = False, early: bool = False, poll1: bool = False):
    """One step: the whole instruction table in one launch (grid = c.n_programs); trace,
    skip: kernel_args'."""
    num_warps = num_warps or NUM_WARPS
    num_stages = num_stages or NUM_STAGES
    args, kw = kernel_args(c, low, unroll, align=align, pre=pre, trace=trace,
                           skip=skip, rpf=rpf, early=early, poll1=poll1)
    kw["STAGES"] = num_stages
    return megakernel[(c.n_programs,)](*args, **kw, **grid_options(c), num_warps=num_warps,
                                       num_stages=num_stages)


def grid_options(c) -> dict:
    """The launch options of a persistent kernel's grid of c.n_programs: cooperative on CUDA
    (an oversized grid fails at launch instead of hanging); under the interpreter, which runs
    programs one after another (a program spinning on another's counter would hang), one."""
    if interpreted():
        assert c.n_programs == 1, "the interpreter runs programs one after another: " \
                                  "compile with n_sm=1"
        return {}
    return {"launch_cooperative_grid": True}
