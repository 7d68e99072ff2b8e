"""The vision tower's attention (head 72) as a Gluon kernel for Hopper: TMA, mbarriers and
asynchronous wgmma written out, where Triton's own pipeliner reached 2.6-2.7 ms per 9-crop
encode in every form built (ops/vision_attention.py; sessions 4, 10, 42) against cuDNN's
2.34 ms, and the H200's units bound it near ~0.7 ms (docs/benchmarks.md, session 42).

    o = vision_attention_gluon(qkv, n_heads)        # qkv [n, T, 3 H 72] bf16/fp16; CONFIG

vision_fused.encoder's attention where it runs (ATTENTION = "auto": `takes`, CUDA with
compute capability 9.x and a Triton with Gluon, else SDPA); "gluon[:BMxBNxSTAGES[xPIPE
[xWS]]]" forces it. bench/probe_gluon_attention.py times configs against SDPA and diagnoses wrong
output (session 44 on an H100: the per-warpgroup form 1.09x cuDNN, the rest 0.66-1.00x).
The reference is ops/vision_attention.vision_attention_reference (SDPA over the views).
Gluon kernels do not run under TRITON_INTERPRET: its tests are GPU tests
(test/core/test_vision_attention_gluon_gpu.py); the CPU compiles it for sm_90
(test_sm90_resources.py).

The kernel: one program per (BM query rows, crop x head); BM = 64 per warpgroup (num_warps
= BM / 16). Q by TMA once; K / V blocks of BN keys by TMA into STAGES shared-memory slots
(the next blocks' copies in flight while one is computed), each head as a 64-column and a
16-column box of the 2-D qkv (columns 72-79 are the next head's, or past the row: zeros by
TMA): S = Q K^T as two wgmmas with q's columns past 72 zeroed in registers, an online
softmax in the accumulator's layout (exp2, fp32 statistics), P in the input dtype from
registers into two PV wgmmas (64 and 16 output columns; columns past 72 are not stored).
A crop's last key block holds rows of the next crop (or TMA's zeros past the tensor): their
scores are -inf and their V rows are zeroed in shared memory before use, so nothing of
another crop (inf / NaN included) reaches a crop's output. PIPE: FlashAttention-3's
in-warpgroup pipeline (block j's S issued with block j-1's PV, block j's softmax while the
PV runs); else S, softmax, PV in turn, the overlap coming from other programs on the SM.
WS "wg" (the default): each warpgroup its own partition of Gluon's warp_specialize (the
serial loop over its 64 rows), the 2 or 4 warpgroups of a program sharing the K / V slots:
each releases a slot by its own mbarrier arrival (`empty`), warpgroup 0 refills a slot once
all have (and zeroes the last block's V rows, the others waiting on `zbar`), so no CTA-wide
barrier keeps the warpgroups in step - in the one-partition kernel they compute S and run
the softmax at the same time, and a CTA of 4 lost to 2 CTAs of 2 (3.03 vs 2.39 ms).
Why the serial loop: an estimate from its SASS and session 45's H100 timings (no profiler) -
~290 instructions per warp per key block, 4 warps per SM sub-partition: ~1200 issue cycles per
round (every warpgroup one block) against ~1300 tensor-core and ~1100 MUFU cycles, yet ~3300
measured (at 1.755 GHz) - each warpgroup's dependent chain (S, softmax, PV) sets the time,
not a unit; yet every way built to put more of it in flight per warpgroup lost
(docs/dropped_experiments.md: FlashAttention-3's in-warpgroup pipeline and ping-pong, more
registers; each key block as two pipelined 32-key halves, session 46: 0.91x).
"""
from __future__ import annotations

import math

import torch

from .vision_attention import _check

try:                                               # Triton >= 3.5 with Gluon's Hopper API
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # a TMA copy into shared memory: `async_load` from Triton 3.7 on (3.6, the H200's,
    # has only the older name, which 3.9 refuses)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # the CTA's barrier: `thread_barrier` in 3.6, `barrier` in 3.9
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton version
    HAVE_GLUON = False

# (BM, BN, STAGES, PIPE, WS): the default config, the fastest measured (session 44 on an
# H100, 27 calls at the 9-crop shape: 2.170 ms vs cuDNN 2.372, 1.09x; the one-partition
# 128x64x2 0.97-1.00x, every other form slower; docs/benchmarks.md)
CONFIG = (128, 64, 2, 0, "wg")
HA, HB = 64, 16          # a head's columns as a 64-wide and a 16-wide part (72 <= 80)


def gluon_available(t: torch.Tensor) -> bool:
    """The kernel can run on t: a Hopper GPU (sm_90) and a Triton with Gluon."""
    return (HAVE_GLUON and t.is_cuda
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def full_config(config: tuple | None) -> tuple:
    """(BM, BN, STAGES[, PIPE[, WS]]) or None (CONFIG) -> (bm, bn, stages, pipe, ws):
    PIPE 0 / 1; WS 0 (one partition) or "wg" (a partition per warpgroup, BM 128 / 256,
    no PIPE)."""
    bm, bn, st, pipe, ws = (tuple(config or CONFIG) + (0, 0))[:5]
    if ws == "wg" and (bm not in (128, 256) or pipe):
        raise ValueError(f"the per-warpgroup form takes BM 128 or 256 without PIPE, not "
                         f"{config}")
    if ws not in (0, "wg"):
        raise ValueError(f"WS is 0 or 'wg', not {ws!r}")
    return int(bm), int(bn), int(st), bool(pipe), ws


def parse_config(config: str) -> tuple:
    """"BMxBNxSTAGES[xPIPE[xWS]]" (WS 0 or "wg") -> full_config's tuple."""
    parts = config.split("x")
    return full_config(tuple(p if p == "wg" else int(p) for p in parts))


if HAVE_GLUON:
    _HA, _HB = gl.constexpr(HA), gl.constexpr(HB)     # (a kernel reads constexpr globals)

    @gluon.constexpr_function
    def _acc_layout(warps, n):
        """wgmma's accumulator layout for [rows, n] over `warps` warps (64 rows a
        warpgroup)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                         instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _a_layout(parent):
        """A wgmma's A operand from registers, for the accumulator layout `parent`."""
        return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=2)

    @gluon.jit
    def _tile(T, H: gl.constexpr, HD: gl.constexpr, BM: gl.constexpr):
        """This program's crop b, its first qkv row, the head's q / k / v columns and its
        first query row."""
        bh = gl.program_id(1)
        b = bh // H
        q_col = (bh % H) * HD
        return b, b * T, q_col, H * HD + q_col, 2 * H * HD + q_col, gl.program_id(0) * BM

    @gluon.jit
    def _start(q_a_s, q_b_s, HD: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr,
               s_l: gl.constexpr, oa_l: gl.constexpr, ob_l: gl.constexpr):
        """Q from shared memory into registers (its columns past HD zeroed) and the online
        softmax's starting state: (q_a, q_b, m_i, l_i, o_a, o_b, s0, kn)."""
        qs_l: gl.constexpr = _a_layout(s_l)
        q_a = q_a_s.load(qs_l)
        q_b = q_b_s.load(qs_l)
        cb = gl.arange(0, _HB, layout=gl.SliceLayout(0, qs_l))
        q_b = gl.where((cb < HD - _HA)[None, :], q_b, gl.zeros_like(q_b))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_l))
        o_a = gl.zeros([ROWS, _HA], gl.float32, layout=oa_l)
        o_b = gl.zeros([ROWS, _HB], gl.float32, layout=ob_l)
        s0 = gl.zeros([ROWS, BN], gl.float32, layout=s_l)
        kn = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        return q_a, q_b, m_i, l_i, o_a, o_b, s0, kn

    @gluon.jit
    def _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, st, row, k_col, v_col):
        bar = bars.index(st)
        mbarrier.expect(bar, 2 * ka_desc.block_type.nbytes + 2 * kb_desc.block_type.nbytes)
        _tma_load(ka_desc, [row, k_col], bar, k_a.index(st))
        _tma_load(kb_desc, [row, k_col + _HA], bar, k_b.index(st))
        _tma_load(ka_desc, [row, v_col], bar, v_a.index(st))
        _tma_load(kb_desc, [row, v_col + _HA], bar, v_b.index(st))

    @gluon.jit
    def _zero_rows_from(buf, n_ok, ROWS: gl.constexpr, COLS: gl.constexpr,
                        num_warps: gl.constexpr):
        """Rows n_ok.. of a shared-memory tile set to 0 (a generic-proxy write: the caller
        fences before an async read)."""
        lay: gl.constexpr = gl.BlockedLayout([1, COLS // 8], [4, 8], [num_warps, 1], [1, 0])
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
        v = buf.load(lay)
        buf.store(gl.where((r < n_ok)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _zero_v_tail(v_a, v_b, st, n_ok, BN: gl.constexpr, num_warps: gl.constexpr):
        """Slot st's V rows n_ok.. zeroed (the block past the crop's end: they hold the next
        crop's values or TMA's zeros), visible to the wgmmas of this partition's warps."""
        _zero_rows_from(v_a.index(st), n_ok, BN, _HA, num_warps)
        _zero_rows_from(v_b.index(st), n_ok, BN, _HB, num_warps)
        fence_async_shared()        # (each thread's stores, then all of them, before
        _cta_barrier()              # the wgmmas read the tile)

    @gluon.jit
    def _landed(bars, v_a, v_b, st, j, T, BN: gl.constexpr, STAGES: gl.constexpr,
                num_warps: gl.constexpr):
        """Wait for key block j's copies (slot st); the block past the crop's end gets its V
        rows from T on zeroed."""
        mbarrier.wait(bars.index(st), (j // STAGES) & 1)
        if (j + 1) * BN > T:
            _zero_v_tail(v_a, v_b, st, T - j * BN, BN, num_warps)

    @gluon.jit
    def _scores(q_a, q_b, k_a, k_b, st, s0):
        sc = warpgroup_mma(q_a, k_a.index(st).permute((1, 0)), s0, use_acc=False,
                           is_async=True)
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
    def _pv(p, v_a, v_b, st, o_a, o_b, pa_l: gl.constexpr, pb_l: gl.constexpr):
        p16 = p.to(v_a.dtype)
        o_a = warpgroup_mma(gl.convert_layout(p16, pa_l), v_a.index(st), o_a, is_async=True)
        o_b = warpgroup_mma(gl.convert_layout(p16, pb_l), v_b.index(st), o_b, is_async=True)
        return o_a, o_b

    @gluon.jit
    def _rescale(o_a, o_b, alpha, oa_l: gl.constexpr, ob_l: gl.constexpr):
        o_a = o_a * gl.convert_layout(alpha, gl.SliceLayout(1, oa_l))[:, None]
        o_b = o_b * gl.convert_layout(alpha, gl.SliceLayout(1, ob_l))[:, None]
        return o_a, o_b

    @gluon.jit
    def _serial_step(q_a, q_b, k_a, k_b, v_a, v_b, st, s0, m_i, l_i, o_a, o_b, j, T, kn,
                     scale_log2e, BN: gl.constexpr, oa_l: gl.constexpr, ob_l: gl.constexpr,
                     pa_l: gl.constexpr, pb_l: gl.constexpr):
        """Key block j (slot st) in turn: S, the online softmax, O rescaled, P V; every
        wgmma waited for (the slot is free on return)."""
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_a, q_b, k_a, k_b, st, s0),))
        p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, T, kn, scale_log2e, BN)
        o_a, o_b = _rescale(o_a, o_b, alpha, oa_l, ob_l)
        o_a, o_b = _pv(p, v_a, v_b, st, o_a, o_b, pa_l, pb_l)
        o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
        return m_i, l_i, o_a, o_b

    @gluon.jit
    def _vision_attention_gluon_kernel(qa_desc, qb_desc, ka_desc, kb_desc, o_ptr, so_b, so_t,
                                       T, scale_log2e, H: gl.constexpr, HD: gl.constexpr,
                                       BM: gl.constexpr, BN: gl.constexpr,
                                       STAGES: gl.constexpr, PIPE: gl.constexpr):
        dt: gl.constexpr = qa_desc.dtype
        num_warps: gl.constexpr = gl.num_warps()
        b, row0, q_col, k_col, v_col, m0 = _tile(T, H, HD, BM)
        s_l: gl.constexpr = _acc_layout(num_warps, BN)
        oa_l: gl.constexpr = _acc_layout(num_warps, _HA)
        ob_l: gl.constexpr = _acc_layout(num_warps, _HB)
        pa_l: gl.constexpr = _a_layout(oa_l)
        pb_l: gl.constexpr = _a_layout(ob_l)
        q_a_s = gl.allocate_shared_memory(dt, [BM, _HA], qa_desc.layout)
        q_b_s = gl.allocate_shared_memory(dt, [BM, _HB], qb_desc.layout)
        k_a = gl.allocate_shared_memory(dt, [STAGES, BN, _HA], ka_desc.layout)
        k_b = gl.allocate_shared_memory(dt, [STAGES, BN, _HB], kb_desc.layout)
        v_a = gl.allocate_shared_memory(dt, [STAGES, BN, _HA], ka_desc.layout)
        v_b = gl.allocate_shared_memory(dt, [STAGES, BN, _HB], kb_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.expect(qbar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
        _tma_load(qa_desc, [row0 + m0, q_col], qbar, q_a_s)
        _tma_load(qb_desc, [row0 + m0, q_col + _HA], qbar, q_b_s)
        n_blocks = gl.cdiv(T, BN)
        for i in gl.static_range(STAGES):
            if i < n_blocks:
                _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, i, row0 + i * BN,
                          k_col, v_col)
        mbarrier.wait(qbar, 0)
        q_a, q_b, m_i, l_i, o_a, o_b, s0, kn = _start(q_a_s, q_b_s, HD, BM, BN, s_l, oa_l,
                                                      ob_l)

        if PIPE:
            _landed(bars, v_a, v_b, 0, 0, T, BN, STAGES, num_warps)
            sc = warpgroup_mma_wait(num_outstanding=0,
                                    deps=(_scores(q_a, q_b, k_a, k_b, 0, s0),))
            p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, 0, T, kn, scale_log2e, BN)
            for j in range(1, n_blocks):
                st = j % STAGES
                prev = (j - 1) % STAGES
                _landed(bars, v_a, v_b, st, j, T, BN, STAGES, num_warps)
                sc = _scores(q_a, q_b, k_a, k_b, st, s0)
                o_a, o_b = _pv(p, v_a, v_b, prev, o_a, o_b, pa_l, pb_l)
                sc = warpgroup_mma_wait(num_outstanding=2, deps=(sc,))
                p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, j, T, kn, scale_log2e, BN)
                o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
                if j - 1 + STAGES < n_blocks:
                    _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, prev,
                              row0 + (j - 1 + STAGES) * BN, k_col, v_col)
                o_a, o_b = _rescale(o_a, o_b, alpha, oa_l, ob_l)
            o_a, o_b = _pv(p, v_a, v_b, (n_blocks - 1) % STAGES, o_a, o_b, pa_l, pb_l)
            o_a, o_b = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b))
        else:
            for j in range(n_blocks):
                st = j % STAGES
                _landed(bars, v_a, v_b, st, j, T, BN, STAGES, num_warps)
                m_i, l_i, o_a, o_b = _serial_step(q_a, q_b, k_a, k_b, v_a, v_b, st, s0, m_i,
                                                  l_i, o_a, o_b, j, T, kn, scale_log2e, BN,
                                                  oa_l, ob_l, pa_l, pb_l)
                if j + STAGES < n_blocks:
                    _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, bars, st,
                              row0 + (j + STAGES) * BN, k_col, v_col)
        mbarrier.invalidate(qbar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        _store(o_ptr, so_b, so_t, T, o_a, o_b, l_i, b, q_col, m0, HD, BM, oa_l, ob_l, dt)

    @gluon.jit
    def _wg_part(shared, WGI: gl.constexpr, HD: gl.constexpr, BN: gl.constexpr,
                 STAGES: gl.constexpr):
        """One warpgroup's 64 query rows (m0 + 64 WGI..) in the per-warpgroup form: its own
        partition, so warpgroups sharing the K / V slots run unsynchronized. Warpgroup 0
        (the default partition) also refills the slots - slot of block j - 1 once every
        warpgroup has released it (`empty`, one arrival per warpgroup) - and zeroes the
        last block's V rows past T (the others wait for `zbar`)."""
        (qa_desc, qb_desc, ka_desc, kb_desc, q_a_s, q_b_s, qbars, k_a, k_b, v_a, v_b, ready,
         empty, zbar, o_ptr, so_b, so_t, T, scale_log2e, b, row0, q_col, k_col, v_col, m0,
         n_blocks) = shared
        LEAD: gl.constexpr = WGI == 0
        dt: gl.constexpr = qa_desc.dtype
        s_l: gl.constexpr = _acc_layout(4, BN)
        oa_l: gl.constexpr = _acc_layout(4, _HA)
        ob_l: gl.constexpr = _acc_layout(4, _HB)
        pa_l: gl.constexpr = _a_layout(oa_l)
        pb_l: gl.constexpr = _a_layout(ob_l)
        m_w = m0 + WGI * 64
        qbar = qbars.index(WGI)
        mbarrier.expect(qbar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
        _tma_load(qa_desc, [row0 + m_w, q_col], qbar, q_a_s.index(WGI))
        _tma_load(qb_desc, [row0 + m_w, q_col + _HA], qbar, q_b_s.index(WGI))
        if LEAD:
            for i in gl.static_range(STAGES):
                if i < n_blocks:
                    _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, ready, i, row0 + i * BN,
                              k_col, v_col)
        mbarrier.wait(qbar, 0)
        q_a, q_b, m_i, l_i, o_a, o_b, s0, kn = _start(q_a_s.index(WGI), q_b_s.index(WGI), HD,
                                                      64, BN, s_l, oa_l, ob_l)
        for j in range(n_blocks):
            st = j % STAGES
            if LEAD:
                if j > 0:
                    if j - 1 + STAGES < n_blocks:
                        prev = (j - 1) % STAGES
                        mbarrier.wait(empty.index(prev), ((j - 1) // STAGES) & 1)
                        _issue_kv(ka_desc, kb_desc, k_a, k_b, v_a, v_b, ready, prev,
                                  row0 + (j - 1 + STAGES) * BN, k_col, v_col)
            mbarrier.wait(ready.index(st), (j // STAGES) & 1)
            if (j + 1) * BN > T:
                if LEAD:
                    _zero_v_tail(v_a, v_b, st, T - j * BN, BN, 4)
                    mbarrier.arrive(zbar, count=1)
                else:
                    mbarrier.wait(zbar, 0)
            m_i, l_i, o_a, o_b = _serial_step(q_a, q_b, k_a, k_b, v_a, v_b, st, s0, m_i, l_i,
                                              o_a, o_b, j, T, kn, scale_log2e, BN, oa_l, ob_l,
                                              pa_l, pb_l)
            mbarrier.arrive(empty.index(st), count=1)
        _store(o_ptr, so_b, so_t, T, o_a, o_b, l_i, b, q_col, m_w, HD, 64, oa_l, ob_l, dt)

    @gluon.jit
    def _vision_attention_wg_kernel(qa_desc, qb_desc, ka_desc, kb_desc, o_ptr, so_b, so_t,
                                    T, scale_log2e, H: gl.constexpr, HD: gl.constexpr,
                                    BM: gl.constexpr, BN: gl.constexpr,
                                    STAGES: gl.constexpr):
        """The per-warpgroup form: BM / 64 warpgroups (2 or 4), each its own partition of
        Gluon's warp_specialize (4 warps each), sharing STAGES K / V slots (qa / qb: 64-row
        boxes, each warpgroup's own rows)."""
        dt: gl.constexpr = qa_desc.dtype
        NWG: gl.constexpr = BM // 64
        b, row0, q_col, k_col, v_col, m0 = _tile(T, H, HD, BM)
        q_a_s = gl.allocate_shared_memory(dt, [NWG, 64, _HA], qa_desc.layout)
        q_b_s = gl.allocate_shared_memory(dt, [NWG, 64, _HB], qb_desc.layout)
        k_a = gl.allocate_shared_memory(dt, [STAGES, BN, _HA], ka_desc.layout)
        k_b = gl.allocate_shared_memory(dt, [STAGES, BN, _HB], kb_desc.layout)
        v_a = gl.allocate_shared_memory(dt, [STAGES, BN, _HA], ka_desc.layout)
        v_b = gl.allocate_shared_memory(dt, [STAGES, BN, _HB], kb_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qbars = gl.allocate_shared_memory(gl.int64, [NWG, 1], mbarrier.MBarrierLayout())
        zbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(zbar, count=1)
        for i in gl.static_range(NWG):
            mbarrier.init(qbars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NWG)
        n_blocks = gl.cdiv(T, BN)
        shared = (qa_desc, qb_desc, ka_desc, kb_desc, q_a_s, q_b_s, qbars, k_a, k_b, v_a, v_b,
                  ready, empty, zbar, o_ptr, so_b, so_t, T, scale_log2e, b, row0, q_col, k_col,
                  v_col, m0, n_blocks)
        if NWG == 2:
            gl.warp_specialize([(_wg_part, (shared, 0, HD, BN, STAGES)),
                                (_wg_part, (shared, 1, HD, BN, STAGES))], [4], [128])
        else:
            gl.warp_specialize([(_wg_part, (shared, 0, HD, BN, STAGES)),
                                (_wg_part, (shared, 1, HD, BN, STAGES)),
                                (_wg_part, (shared, 2, HD, BN, STAGES)),
                                (_wg_part, (shared, 3, HD, BN, STAGES))],
                               [4, 4, 4], [128, 128, 128])

    @gluon.jit
    def _store(o_ptr, so_b, so_t, T, o_a, o_b, l_i, b, q_col, m0, HD: gl.constexpr,
               BM: gl.constexpr, oa_l: gl.constexpr, ob_l: gl.constexpr, dt: gl.constexpr):
        inv_a = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, oa_l))
        inv_b = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, ob_l))
        ra = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, oa_l))
        ca = gl.arange(0, _HA, layout=gl.SliceLayout(0, oa_l))
        base = o_ptr + b.to(gl.int64) * so_b + q_col
        gl.store(base + ra[:, None] * so_t + ca[None, :], (o_a * inv_a[:, None]).to(dt),
                 mask=(ra < T)[:, None])
        rb = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ob_l))
        cbo = gl.arange(0, _HB, layout=gl.SliceLayout(0, ob_l))
        gl.store(base + _HA + rb[:, None] * so_t + cbo[None, :],
                 (o_b * inv_b[:, None]).to(dt), mask=(rb < T)[:, None] & (cbo < HD - _HA)[None, :])


def takes(qkv: torch.Tensor, n_heads: int) -> bool:
    """The kernel runs on qkv: a Hopper GPU with Gluon (`gluon_available`) and a shape /
    dtype `check_shape` accepts."""
    if not gluon_available(qkv):
        return False
    try:
        check_shape(qkv, n_heads)
    except ValueError:
        return False
    return True


def check_shape(qkv: torch.Tensor, n_heads: int) -> tuple[int, int, int]:
    """(n, T, hd) of a qkv the kernel takes, else ValueError: 64 < hd <= 80, bf16 / fp16,
    hd a multiple of 8 (so 72 or 80): a TMA copy's innermost coordinate must lie on 16
    bytes (the head's column h hd; head 68 stopped the H100 with "illegal instruction",
    session 44), which also makes rows a multiple of 16 bytes (TMA's global strides)."""
    n, t, hd = _check(qkv, n_heads)
    if not HA < hd <= HA + HB or qkv.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the Gluon vision attention takes 64 < head_dim <= 80 in bf16 / "
                         f"fp16, not {hd} in {qkv.dtype}")
    if (hd * qkv.element_size()) % 16:
        raise ValueError(f"the Gluon vision attention's TMA copies start at each head's "
                         f"columns, which must lie on 16 bytes: head_dim {hd} x "
                         f"{qkv.element_size()} bytes is not a multiple of 16")
    return n, t, hd


def descriptors(qkv: torch.Tensor, bm: int, bn: int) -> tuple:
    """The kernel's four TMA descriptors over qkv as 2-D [n T, 3 H hd] (q: BM rows, k / v:
    BN rows; 64- and 16-column boxes)."""
    n, t, width = qkv.shape
    q2 = qkv.view(n * t, width)
    dt = gl.bfloat16 if qkv.dtype == torch.bfloat16 else gl.float16

    def desc(rows, cols):
        return TensorDescriptor.from_tensor(
            q2, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], dt))
    return desc(bm, HA), desc(bm, HB), desc(bn, HA), desc(bn, HB)


def vision_attention_gluon(qkv: torch.Tensor, n_heads: int, config: tuple | None = None
                           ) -> torch.Tensor:
    """qkv [n, T, 3 H hd] (64 < hd <= 80, bf16 / fp16, contiguous, a Hopper GPU) -> o [n, T,
    H hd] contiguous. config: (BM, BN, STAGES[, PIPE[, WS]]), default CONFIG
    (`full_config`)."""
    if not gluon_available(qkv):
        raise RuntimeError("the Gluon vision attention needs a Hopper GPU (sm_90) and a "
                           "Triton with Gluon; use attention 'sdpa' or 'triton'")
    n, t, hd = check_shape(qkv, n_heads)
    qkv = qkv.contiguous()
    bm, bn, stages, pipe, ws = full_config(config)
    o = torch.empty(n, t, n_heads * hd, device=qkv.device, dtype=qkv.dtype)
    qa, qb, ka, kb = descriptors(qkv, 64 if ws == "wg" else bm, bn)
    args = (qa, qb, ka, kb, o, o.stride(0), o.stride(1), t, hd ** -0.5 * math.log2(math.e))
    meta = dict(H=n_heads, HD=hd, BM=bm, BN=bn, STAGES=stages)
    grid = (math.ceil(t / bm), n * n_heads)
    if ws == "wg":      # 4 warps per partition; 128 registers: 2 CTAs per SM at BM 128
        _vision_attention_wg_kernel[grid](*args, **meta, num_warps=4, maxnreg=128)
    else:
        _vision_attention_gluon_kernel[grid](*args, **meta, PIPE=bool(pipe),
                                             num_warps=bm // 16)
    return o


__all__ = ["CONFIG", "HAVE_GLUON", "check_shape", "full_config", "gluon_available",
           "parse_config", "takes", "vision_attention_gluon"]
