"""One decode step of attention per (row, head) over the static KV cache, split over the
sequence (flash-decoding), with the partial rotary embedding and the cache write fused in.

attend_partial, grid (rows, n_heads, n_splits): q, k, v of the row's new token come from the
fused projection output (qkv [rows, >= (nh + 2 nkv) hd]); q and k get the partial rotary
embedding at the row's position (fp32 math with the table's cos/sin, rounded to the cache
dtype, rotated pairs written interleaved, like rope.apply_rope), the new k/v are written at the row's clamped position
pw = min(pos, capacity - 1) by the split that holds pw, and each split computes the
softmax partials (max, sum, weighted v) over its chunk of keys j <= pw: keys j < pw from the
cache, key pw from registers (so no program reads what another one writes). With
SKIP_EMPTY_SPLITS (on) a split past the row's position returns at once and the combine
leaves it out.
combine: merges the splits and writes the head's output (cache dtype) into
out[row, head * hd : (head + 1) * hd], in a second kernel, grid (rows, n_heads) (default), or
(FUSE_COMBINE) inside attend_partial by the last split program of each (row, head) to finish
(an acq_rel atomic counter per (row, head), reset by that program; partials read through
L2): one launch fewer per layer, but measured slower on the H200 (7.87 vs 7.44 us/layer).

Torch references (the eager backend's attention op): `decode_attention_reference` (one query
per row at its own position, the same rotary / cache write / masked attention) and
`prefill_attention_reference` (the prompt's tokens of one row, causal over the whole row).
decode_attention(..., kv_row=row) is the prompt prefill's kernel form: every token's k/v
written first (_prefill_kv_write_kernel), then the split attention per (head, split) over
blocks of tokens (_prefill_attend_kernel: each chunk of keys read once for the block), or
with PREFILL_TOKENS = 0 per (token, head, split) (_attend_partial_kernel with PREFILL).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


# H200: in-kernel merge 7.87 us/layer vs 7.44 with the combine kernel (b=1, session 1); with
# the skip, Moondream 2's fused steps at 760, b = 1 / 2 / 4 / 8: 0.99x / 1.00x / 1.00x / 0.98x
# (session 36 call 7: the combine's launch moves into each split's atomic and the last one's
# merge)
FUSE_COMBINE = False
# warps of _attend_partial_kernel at one row, and the (key chunk, warps) it uses from
# ROWS_MIN rows (or prompt tokens) up where the scratch has room for that many splits: H200,
# 24 layers' caches, us per layer (bench/bench_attention_warps.py, docs/benchmarks.md session 9
# call 15): 2 warps x 64 keys vs 4 x 128 at b = 2 / 4 / 8: 9.11 / 12.90 / 19.81 vs 9.66 / 13.70
# / 21.43 (at b = 1 1.06x as well, but one row keeps the scratch's chunk: the megakernel's
# attention and schedule use it)
ATTEND_WARPS = 4
ROWS_MIN, ROWS_CHUNK, ROWS_WARPS = 2, 64, 2
# the prompt prefill: up to PREFILL_TOKENS tokens per program of _prefill_attend_kernel
# (0: the per-token form, _attend_partial_kernel with PREFILL), with PREFILL_WARPS warps.
# H200, 24 layers after a 730-token prefix, us per prefill of T = 8 / 16 tokens
# (bench/profile_prompt_prefill.py, docs/benchmarks.md session 10 call 3): per token 326 /
# 587; blocks of 16 with 1 / 2 / 4 warps 157 / 152 / 148 and 198 / 184 / 175
PREFILL_TOKENS, PREFILL_WARPS = 16, 4
# decode: a split past its row's position (the cache's unused tail: 4 of 16 splits at
# position 760 in a 1024-slot cache) returns at once instead of computing an empty partial,
# and the combine merges the splits before it: the same bits. H200, Moondream 2's fused step
# at position 760 (docs/benchmarks.md session 35 call 11), b = 1 / 2 / 4 / 8: 0.9463 /
# 1.0394 / 1.1768 / 1.3369 ms vs 0.9560 / 1.0594 / 1.1858 / 1.3849 computing them; at 1000
# (no split empty) b = 2 / 8 1.0673 / 1.4321 vs 1.0841 / 1.4259. On since session 36: the
# fresh-machine GPU test failures that kept it opt-in in session 35 were a garbage
# collection freeing a dead CUDA graph inside a capture (fast/cuda_graph_runner.PAUSE_GC),
# not this kernel
SKIP_EMPTY_SPLITS = True


@triton.jit
def rotary_sources(d, cos_ptr, sin_ptr, ti, HALF: tl.constexpr):
    """The rotation of channels d at table row ti, in rope.apply_rope's interleaved order:
    output d < 2*HALF holds pair j = d // 2 (re_j = x[j], im_j = x[HALF + j]); even d:
    re_j cos - im_j sin, odd d: im_j cos + re_j sin; d >= 2*HALF passes through. Returns
    (src_c, src_s, c, s): output d = x[src_c] * c + x[src_s] * s. Shared by the decode kernel,
    the prefill's rope_kv_write and the megakernel, so their cached keys agree bitwise."""
    rot = d < 2 * HALF
    even = (d % 2) == 0
    fi = tl.where(rot, d // 2, 0)
    src_c = tl.where(rot, tl.where(even, fi, fi + HALF), d)
    src_s = tl.where(rot, tl.where(even, fi + HALF, fi), d)
    c = tl.where(rot, tl.load(cos_ptr + ti * HALF + fi), 1.0)
    s = tl.load(sin_ptr + ti * HALF + fi)
    s = tl.where(rot, tl.where(even, -s, s), 0.0)
    return src_c, src_s, c, s


@triton.jit
def _valid_splits(pw, CHUNK: tl.constexpr, NSPLIT: tl.constexpr):
    """How many of a row's splits hold its keys (the clamped position pw's split and those
    before it; none at a negative position - Triton's division truncates, so -1 // CHUNK + 1
    would be 1)."""
    return tl.minimum(tl.where(pw >= 0, pw // CHUNK + 1, 0), NSPLIT)


@triton.jit
def _merge(m_ptr, l_ptr, acc_ptr, out_ptr, stride_out, row, h,
           NH: tl.constexpr, HD: tl.constexpr, NSPLIT: tl.constexpr, n_valid,
           ORDERED: tl.constexpr = False):
    """The (row, head)'s first n_valid splits' partials (those past them hold no key: as
    m = -inf, l = 0, acc = 0 their terms are 0, so leaving them out gives the same bits)
    merged into out.
    ORDERED (the megakernel's merge; the fused step's in deterministic mode): the splits are
    added one after another in split order (an unrolled chain of fused multiply-adds over
    [HD] vectors; the max is exact in any order). No sum runs across the program's threads,
    so the order does not follow the kernel's layout (warps, the loads' vector width): the
    combine kernel (2 warps) and the megakernel's merge (4 or 8 warps, operands from its
    table), compiled apart, give the same bits. Otherwise the [splits, HD] tile is summed by
    tl.sum, whose tree follows the layout: on the H200 the megakernel and the fused
    deterministic step parted by one bf16 step (session 37), but the tile's vector loads
    are faster at 4-8 rows (16 splits of 64 keys: 0.98x steps in order, session 37 call 2)."""
    base = (row * NH + h) * NSPLIT
    d = tl.arange(0, HD)
    if not ORDERED:
        P2: tl.constexpr = triton.next_power_of_2(NSPLIT)
        sidx = tl.arange(0, P2)
        sok = sidx < n_valid
        m = tl.load(m_ptr + base + sidx, mask=sok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + base + sidx, mask=sok, other=0.0, cache_modifier=".cg")
        mx = tl.max(m, axis=0)
        wt = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
        acc = tl.load(acc_ptr + (base + sidx[:, None]) * HD + d[None, :], mask=sok[:, None],
                      other=0.0, cache_modifier=".cg")
        o = tl.sum(acc * wt[:, None], axis=0) / tl.sum(l * wt, axis=0)
        tl.store(out_ptr + row * stride_out + h * HD + d, o.to(out_ptr.dtype.element_ty))
        return
    split = tl.full([], 0, tl.int32)        # (a tensor: n_valid may be a constant)
    mx = tl.load(m_ptr + base, mask=split < n_valid, other=float("-inf"), cache_modifier=".cg")
    for s in tl.static_range(1, NSPLIT):
        mx = tl.maximum(mx, tl.load(m_ptr + base + s, mask=split + s < n_valid,
                                    other=float("-inf"), cache_modifier=".cg"))
    num = tl.zeros([HD], dtype=tl.float32)
    den = tl.full([], 0.0, tl.float32)
    for s in tl.static_range(NSPLIT):
        ok = split + s < n_valid
        m = tl.load(m_ptr + base + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
        wt = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
        l = tl.load(l_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(acc_ptr + (base + s) * HD + d, mask=d * 0 + split + s < n_valid,
                      other=0.0, cache_modifier=".cg")
        num = tl.fma(acc, wt, num)
        den = tl.fma(l, wt, den)
    tl.store(out_ptr + row * stride_out + h * HD + d, (num / den).to(out_ptr.dtype.element_ty))


@triton.jit
def _attend_partial_kernel(qkv_ptr, stride_qkv, pos_ptr, cos_ptr, sin_ptr, n_table,
                           kc_ptr, vc_ptr, s_row, s_head, s_pos, capacity,
                           m_ptr, l_ptr, acc_ptr, scale, cnt_ptr, out_ptr, stride_out,
                           kv_row_ptr,
                           NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                           HALF: tl.constexpr, CHUNK: tl.constexpr, NSPLIT: tl.constexpr,
                           COMBINE: tl.constexpr, ORDERED: tl.constexpr = False,
                           PREFILL: tl.constexpr = False, GDC: tl.constexpr = False,
                           SKIP_EMPTY: tl.constexpr = False):
    """PREFILL: program row = a prompt token of the ONE cache row kv_row_ptr[0], whose k/v
    _prefill_kv_write_kernel wrote before (no store here: tokens read each other's keys).
    SKIP_EMPTY (not with PREFILL): a split that holds no key of its row (past the row's
    position) computes no partials; the combine (or with COMBINE the last split to finish,
    an empty one counting too) merges the splits before it only (the same bits)."""
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr + row)
    pw = tl.minimum(pos, capacity - 1)
    if (sp * CHUNK <= pw) | (not SKIP_EMPTY):     # (a constant true without SKIP_EMPTY)
        _attend_split(qkv_ptr, stride_qkv, pos, pw, cos_ptr, sin_ptr, n_table, kc_ptr, vc_ptr,
                      s_row, s_head, s_pos, m_ptr, l_ptr, acc_ptr, scale, kv_row_ptr, row, h,
                      sp, NH, NKV, HD, HALF, CHUNK, NSPLIT, PREFILL)
    if COMBINE:     # (an empty split counts too: the last to finish merges the valid ones)
        done = tl.atomic_add(cnt_ptr + row * NH + h, 1, sem="acq_rel")
        if done == NSPLIT - 1:           # the last split of this (row, head) merges
            n_valid = NSPLIT
            if SKIP_EMPTY:
                n_valid = _valid_splits(pw, CHUNK, NSPLIT)
            _merge(m_ptr, l_ptr, acc_ptr, out_ptr, stride_out, row, h, NH, HD, NSPLIT,
                   n_valid, ORDERED)
            tl.atomic_xchg(cnt_ptr + row * NH + h, 0)


@triton.jit
def _attend_split(qkv_ptr, stride_qkv, pos, pw, cos_ptr, sin_ptr, n_table, kc_ptr, vc_ptr,
                  s_row, s_head, s_pos, m_ptr, l_ptr, acc_ptr, scale, kv_row_ptr, row, h, sp,
                  NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                  CHUNK: tl.constexpr, NSPLIT: tl.constexpr, PREFILL: tl.constexpr):
    """Split sp of (row, h): its partials (max, sum, weighted v) over keys sp * CHUNK ..,
    and the new k / v written by the split that holds pw."""
    kvh = h // (NH // NKV)
    ti = tl.minimum(pos, n_table - 1)
    d = tl.arange(0, HD)
    # the chunk's cached keys/values first: they depend only on the position, so both tiles
    # are in flight while q/k/v are loaded and rotated
    start = sp * CHUNK
    if PREFILL:
        cache_off = tl.load(kv_row_ptr) * s_row + kvh * s_head
    else:
        cache_off = row * s_row + kvh * s_head
    j = start + tl.arange(0, CHUNK)
    in_cache = j < pw
    kt = tl.load(kc_ptr + cache_off + j[:, None] * s_pos + d[None, :], mask=in_cache[:, None],
                 other=0.0)
    vt = tl.load(vc_ptr + cache_off + j[:, None] * s_pos + d[None, :], mask=in_cache[:, None],
                 other=0.0)
    # rotated channels are written interleaved (rope.apply_rope's order; rotary_sources)
    src_c, src_s, c, s = rotary_sources(d, cos_ptr, sin_ptr, ti, HALF)
    base = qkv_ptr + row * stride_qkv
    q_off = h * HD
    k_off = NH * HD + kvh * HD
    v_off = (NH + NKV) * HD + kvh * HD
    q = tl.load(base + q_off + src_c).to(tl.float32) * c \
        + tl.load(base + q_off + src_s).to(tl.float32) * s
    k_new = tl.load(base + k_off + src_c).to(tl.float32) * c \
        + tl.load(base + k_off + src_s).to(tl.float32) * s
    v_new = tl.load(base + v_off + d)
    q = q.to(kc_ptr.dtype.element_ty).to(tl.float32)
    k_new = k_new.to(kc_ptr.dtype.element_ty)
    if (pw >= start) & (pw < start + CHUNK) & (h % (NH // NKV) == 0) & (not PREFILL):
        tl.store(kc_ptr + cache_off + pw * s_pos + d, k_new)
        tl.store(vc_ptr + cache_off + pw * s_pos + d, v_new.to(vc_ptr.dtype.element_ty))
    sc = scores(kt, q, scale)
    sc_new = tl.sum(k_new.to(tl.float32) * q, axis=0) * scale
    split_partials(sc, vt, v_new, sc_new, sp, pw, m_ptr, l_ptr, acc_ptr, row, h, NH, HD,
                   CHUNK, NSPLIT)


@triton.jit
def scores(kt, q, scale):
    """The scaled scores of q (fp32) against a split's cached keys kt [CHUNK, HD]."""
    return tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * scale


@triton.jit
def split_partials(sc, vt, v_new, sc_new, sp, pw, m_ptr, l_ptr, acc_ptr, row, h,
                   NH: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr,
                   NSPLIT: tl.constexpr):
    """One split's softmax partials into the scratch at ((row, h), sp): the max m of its
    scores over keys j <= pw, the sum l of exp(score - m) and the exp-weighted sum of
    values. sc: `scores` of the split's cached keys, vt: its cached values (0 from pw on);
    the new key's score sc_new and value v_new stand at key pw. The decode kernel's and the
    megakernel's attention (megakernel/kernel.py) both, so their partials agree bitwise."""
    d = tl.arange(0, HD)
    j = sp * CHUNK + tl.arange(0, CHUNK)
    cur = j == pw
    sc = tl.where(cur, sc_new, sc)
    valid = j <= pw
    sc = tl.where(valid, sc, float("-inf"))
    m = tl.max(sc, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(valid, tl.exp(sc - m_safe), 0.0)
    l = tl.sum(p, axis=0)
    p_cur = tl.sum(tl.where(cur, p, 0.0), axis=0)
    acc = tl.sum(p[:, None] * vt.to(tl.float32), axis=0) + p_cur * v_new.to(tl.float32)
    idx = (row * NH + h) * NSPLIT + sp
    tl.store(m_ptr + idx, m)
    tl.store(l_ptr + idx, l)
    tl.store(acc_ptr + idx * HD + d, acc)


@triton.jit
def _prefill_kv_write_kernel(qkv_ptr, stride_qkv, pos_ptr, cos_ptr, sin_ptr, n_table,
                             kv_row_ptr, kc_ptr, vc_ptr, s_row, s_head, s_pos, capacity,
                             NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                             HALF: tl.constexpr, GDC: tl.constexpr = False):
    """A prompt token's rotated k and its v into row kv_row_ptr[0] of the cache at its
    clamped position: the attend kernel's own rotation of a new key (same expression)."""
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    pw = tl.minimum(pos, capacity - 1)
    ti = tl.minimum(pos, n_table - 1)
    d = tl.arange(0, HD)
    src_c, src_s, c, s = rotary_sources(d, cos_ptr, sin_ptr, ti, HALF)
    base = qkv_ptr + t * stride_qkv
    k_off = NH * HD + kvh * HD
    v_off = (NH + NKV) * HD + kvh * HD
    k_new = tl.load(base + k_off + src_c).to(tl.float32) * c \
        + tl.load(base + k_off + src_s).to(tl.float32) * s
    v_new = tl.load(base + v_off + d)
    cache = tl.load(kv_row_ptr) * s_row + kvh * s_head + pw * s_pos + d
    tl.store(kc_ptr + cache, k_new.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + cache, v_new.to(vc_ptr.dtype.element_ty))


@triton.jit
def _prefill_attend_kernel(qkv_ptr, stride_qkv, pos_ptr, n_tok, cos_ptr, sin_ptr, n_table,
                           kc_ptr, vc_ptr, s_row, s_head, s_pos, capacity, kv_row_ptr,
                           m_ptr, l_ptr, acc_ptr, scale,
                           NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                           HALF: tl.constexpr, CHUNK: tl.constexpr, NSPLIT: tl.constexpr,
                           TP: tl.constexpr, IP: tl.constexpr,
                           GDC: tl.constexpr = False):
    """The prompt prefill's split attention, grid (heads, splits, token blocks of TP): one
    program reads its chunk of the row's keys / values ONCE for all the block's tokens
    (the per-token form read it once per token: at T = 8 / 16 after a 730-token prefix
    327 / 587 us per prefill on the H200, the GEMVs 752 / 775). Scores and the weighted
    values as tensor-core dots in the cache dtype with fp32 sums (q rounded to it as in the
    per-token form: its products are exact; the probabilities rounded to it for the values'
    dot, as prefill_attention_reference does; fp32 caches: IP = "ieee" dots), the decode
    kernel's softmax partials per token (key j visible to the token at position p if
    j <= min(p, capacity - 1); every token's k/v is in the cache:
    _prefill_kv_write_kernel ran first)."""
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    h = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.program_id(2) * TP + tl.arange(0, TP)
    t_ok = t < n_tok
    kvh = h // (NH // NKV)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0)
    pw = tl.where(t_ok, tl.minimum(pos, capacity - 1), -1)
    ti = tl.minimum(pos, n_table - 1)
    last = tl.max(pw, axis=0)
    d = tl.arange(0, HD)
    j = sp * CHUNK + tl.arange(0, CHUNK)
    cache_off = tl.load(kv_row_ptr) * s_row + kvh * s_head
    seen = j <= last
    kt = tl.load(kc_ptr + cache_off + j[:, None] * s_pos + d[None, :], mask=seen[:, None],
                 other=0.0)
    vt = tl.load(vc_ptr + cache_off + j[:, None] * s_pos + d[None, :], mask=seen[:, None],
                 other=0.0)
    src_c, src_s, c, s = rotary_sources(d[None, :], cos_ptr, sin_ptr, ti[:, None], HALF)
    base = qkv_ptr + t[:, None] * stride_qkv + h * HD
    q = tl.load(base + src_c, mask=t_ok[:, None], other=0.0).to(tl.float32) * c \
        + tl.load(base + src_s, mask=t_ok[:, None], other=0.0).to(tl.float32) * s
    q = q.to(kc_ptr.dtype.element_ty)
    sc = tl.dot(q, tl.trans(kt), input_precision=IP) * scale              # [TP, CHUNK]
    valid = j[None, :] <= pw[:, None]
    sc = tl.where(valid, sc, float("-inf"))
    m = tl.max(sc, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(valid, tl.exp(sc - m_safe[:, None]), 0.0)
    l = tl.sum(p, axis=1)
    acc = tl.dot(p.to(vt.dtype), vt, input_precision=IP)                   # [TP, HD]
    idx = (t * NH + h) * NSPLIT + sp
    tl.store(m_ptr + idx, m, mask=t_ok)
    tl.store(l_ptr + idx, l, mask=t_ok)
    tl.store(acc_ptr + idx[:, None] * HD + d[None, :], acc, mask=t_ok[:, None])


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_out, pos_ptr, capacity,
                    NH: tl.constexpr, HD: tl.constexpr, NSPLIT: tl.constexpr,
                    GDC: tl.constexpr = False,
                    CHUNK: tl.constexpr = 0, ORDERED: tl.constexpr = False):
    """CHUNK > 0: merge only the splits that hold keys of the row (the attend kernel's
    SKIP_EMPTY form computes no others); 0: all NSPLIT."""
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    n_valid = NSPLIT
    if CHUNK > 0:
        n_valid = _valid_splits(tl.minimum(tl.load(pos_ptr + row), capacity - 1), CHUNK,
                                NSPLIT)
    _merge(m_ptr, l_ptr, acc_ptr, out_ptr, stride_out, row, tl.program_id(1),
           NH, HD, NSPLIT, n_valid, ORDERED)


class AttentionScratch:
    """fp32 split partials for `rows` rows (preallocated: graph-capturable). chunk: keys per
    split (n_split of them cover the capacity); min_chunk: the partials are sized for chunks
    down to that (a launch may use a smaller chunk than `chunk`: attend_config)."""

    def __init__(self, rows: int, n_heads: int, head_dim: int, capacity: int, chunk: int,
                 device, min_chunk: int | None = None):
        self.chunk = chunk
        self.n_split = triton.cdiv(capacity, chunk)
        self.max_split = max(self.n_split, triton.cdiv(capacity, min_chunk or chunk))
        self.m = torch.empty(rows * n_heads * self.max_split, device=device,
                             dtype=torch.float32)
        self.l = torch.empty_like(self.m)
        self.acc = torch.empty(rows * n_heads * self.max_split * head_dim, device=device,
                               dtype=torch.float32)
        self.count = torch.zeros(rows * n_heads, device=device, dtype=torch.int32)


def attend_config(b: int, capacity: int, scratch: AttentionScratch) -> tuple[int, int]:
    """(keys per split, warps) of the attention kernel for b rows (or prompt tokens):
    ROWS_CHUNK / ROWS_WARPS from ROWS_MIN rows where the scratch holds that many splits, else
    the scratch's chunk with ATTEND_WARPS."""
    if b >= ROWS_MIN and triton.cdiv(capacity, ROWS_CHUNK) <= scratch.max_split:
        return ROWS_CHUNK, ROWS_WARPS
    return scratch.chunk, ATTEND_WARPS


def decode_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor,
                     scratch: AttentionScratch, n_heads: int, n_kv_heads: int,
                     head_dim: int, fuse_combine: bool | None = None,
                     pdl: bool = False, kv_row: torch.Tensor | None = None,
                     ordered: bool = False) -> torch.Tensor:
    """qkv [b, >= (nh+2nkv)hd]; pos [b] long; cos/sin [n_table, rot/2] fp32 (rope_angles of
    0..n_table-1); kc/vc [rows >= b, nkv, capacity, hd] views of one layer of the static
    cache (unit stride on hd); out [b, >= nh*hd]. ordered: the splits merged in split order
    (_merge's ORDERED: the megakernel's bits; the fused backend's deterministic mode)
    kv_row ([1] long): a prompt prefill instead - the b rows of qkv / pos / out are b tokens
    of that one cache row, causal (key <= the token's position: the earlier tokens' keys
    too): one launch writes every token's k/v, then the split attention reads them
    (prefill_attention_reference's result within rounding: its fp32 softmax, the dots'
    sums in fp32; the per-token form computes the scores and weighted values in fp32)."""
    b = qkv.shape[0]
    capacity = kc.shape[2]
    half = cos.shape[1]
    assert kc.stride() == vc.stride() and kc.stride(3) == 1 and qkv.stride(1) == 1
    assert capacity <= scratch.n_split * scratch.chunk
    chunk, warps = attend_config(b, capacity, scratch)
    n_split = triton.cdiv(capacity, chunk)
    fuse = FUSE_COMBINE if fuse_combine is None else fuse_combine
    _, gdc, launch_kw = pdl_launch(pdl, qkv)
    if kv_row is not None:
        _prefill_kv_write_kernel[(b, n_kv_heads)](
            qkv, qkv.stride(0), pos, cos, sin, cos.shape[0], kv_row, kc, vc, kc.stride(0),
            kc.stride(1), kc.stride(2), capacity,
            NH=n_heads, NKV=n_kv_heads, HD=head_dim, HALF=half, GDC=gdc, num_warps=1,
            **launch_kw)
        if PREFILL_TOKENS:
            tp = min(PREFILL_TOKENS, max(16, triton.next_power_of_2(b)))
            _prefill_attend_kernel[(n_heads, n_split, triton.cdiv(b, tp))](
                qkv, qkv.stride(0), pos, b, cos, sin, cos.shape[0], kc, vc, kc.stride(0),
                kc.stride(1), kc.stride(2), capacity, kv_row, scratch.m, scratch.l,
                scratch.acc, head_dim ** -0.5,
                NH=n_heads, NKV=n_kv_heads, HD=head_dim, HALF=half, CHUNK=chunk,
                NSPLIT=n_split, TP=tp, IP="ieee" if kc.dtype == torch.float32 else "tf32",
                GDC=gdc, num_warps=PREFILL_WARPS, **launch_kw)
            fuse = False
    skip = SKIP_EMPTY_SPLITS and kv_row is None
    if kv_row is None or not PREFILL_TOKENS:
        _attend_partial_kernel[(b, n_heads, n_split)](
            qkv, qkv.stride(0), pos, cos, sin, cos.shape[0], kc, vc, kc.stride(0),
            kc.stride(1), kc.stride(2), capacity, scratch.m, scratch.l, scratch.acc,
            head_dim ** -0.5, scratch.count, out, out.stride(0),
            pos if kv_row is None else kv_row,
            NH=n_heads, NKV=n_kv_heads, HD=head_dim, HALF=half, CHUNK=chunk,
            NSPLIT=n_split, COMBINE=fuse, ORDERED=ordered, PREFILL=kv_row is not None,
            GDC=gdc, num_warps=warps, SKIP_EMPTY=skip, **launch_kw)
    if not fuse:
        _combine_kernel[(b, n_heads)](scratch.m, scratch.l, scratch.acc, out, out.stride(0),
                                      # (positions read only with the skip; else any
                                      # pointer: the default launches stay as before)
                                      pos if skip else scratch.count, capacity,
                                      NH=n_heads, HD=head_dim, NSPLIT=n_split,
                                      GDC=gdc, CHUNK=chunk if skip else 0,
                                      ORDERED=ordered,
                                      num_warps=2, **launch_kw)
    return out


# -- torch references ---------------------------------------------------------------------
def attend(q, keys, values, mask, sdpa: bool) -> torch.Tensor:
    """One query per row against the static cache (mask: bool [b, 1, 1, L] for SDPA, else
    additive [b*nh, 1, L]). Measured (docs/benchmarks.md): on the H200, masked SDPA is ~5 %
    faster per step than matmul + softmax + matmul (2.33 vs 2.46 ms at batch 1); on the CPU
    masked SDPA is ~30x slower than the matmul form. EngineOptions.attention picks."""
    b, nh, _, hd = q.shape
    if sdpa:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != nh)
    length = keys.shape[2]
    k3 = keys.reshape(b * nh, length, hd)
    v3 = values.reshape(b * nh, length, hd)
    scores = torch.baddbmm(mask, q.reshape(b * nh, 1, hd), k3.transpose(1, 2),
                           alpha=hd ** -0.5)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, v3).view(b, nh, 1, hd)


def decode_mask(pos: torch.Tensor, key_ids: torch.Tensor, attn_len: int, n_heads: int,
                dtype, sdpa: bool) -> torch.Tensor:
    """Keys <= each row's position: bool [b, 1, 1, L] (SDPA) or additive [b*nh, 1, L]."""
    b = pos.shape[0]
    visible = key_ids[None, :attn_len] <= pos[:, None]                   # [b, L]
    if sdpa:
        return visible[:, None, None, :]
    mask = torch.zeros(b, attn_len, device=pos.device, dtype=dtype).masked_fill(
        ~visible, float("-inf"))
    return mask[:, None, :].expand(b, n_heads, attn_len).reshape(b * n_heads, 1, attn_len)


def decode_attention_reference(qkv: torch.Tensor, rows: torch.Tensor, pos_w: torch.Tensor,
                               kc: torch.Tensor, vc: torch.Tensor, rope_c: torch.Tensor,
                               rope_s: torch.Tensor, perm: torch.Tensor, mask: torch.Tensor,
                               sdpa: bool, n_heads: int, n_kv_heads: int, head_dim: int,
                               attn_len: int) -> torch.Tensor:
    """qkv [b, (nh+2nkv)hd] of each row's new token -> attention output [b, nh*hd]: q and k
    rotated (ops/rope.py rope with the step's tables), k/v written into rows `rows` at
    positions pos_w of the layer's cache kc/vc [rows, nkv, capacity, hd], then attention over
    the first attn_len keys of rows [0, b) with the mask (decode_mask)."""
    from .rope import rope
    b = qkv.shape[0]
    nh, nkv, hd = n_heads, n_kv_heads, head_dim
    qk = rope(qkv[:, :(nh + nkv) * hd].view(b, nh + nkv, 1, hd), rope_c, rope_s, perm)
    q, k = qk[:, :nh], qk[:, nh:]
    v = qkv[:, (nh + nkv) * hd:(nh + 2 * nkv) * hd]
    kc[rows, :, pos_w] = k[:, :, 0]
    vc[rows, :, pos_w] = v.view(b, nkv, hd)
    a = attend(q, kc[:b, :, :attn_len], vc[:b, :, :attn_len], mask, sdpa)
    return a.reshape(b, nh * hd)


def prefill_attention_reference(qkv: torch.Tensor, row: torch.Tensor, pos_w: torch.Tensor,
                                kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, mask_add: torch.Tensor, n_heads: int,
                                n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, (nh+2nkv)hd] of a prompt's T tokens in row `row` ([1] long) at positions
    pos_w [T] -> [T, nh*hd]: rotary (apply_rope with cos/sin [T, rot/2]), k/v written, then
    attention over the row's whole cache with the additive fp32 mask_add [T, capacity]
    (causal: key <= the token's position)."""
    from .rope import apply_rope
    T = qkv.shape[0]
    nh, nkv, hd = n_heads, n_kv_heads, head_dim
    qk = apply_rope(qkv[None, :, :(nh + nkv) * hd].view(1, T, nh + nkv, hd).transpose(1, 2),
                    cos, sin)
    q, k = qk[:, :nh], qk[:, nh:]
    v = qkv[None, :, (nh + nkv) * hd:(nh + 2 * nkv) * hd].view(1, T, nkv, hd).transpose(1, 2)
    kc[row, :, pos_w] = k[0].transpose(0, 1)
    vc[row, :, pos_w] = v[0].transpose(0, 1)
    keys, values = kc.index_select(0, row), vc.index_select(0, row)      # [1, Hkv, C, D]
    rep = nh // nkv
    if rep > 1:
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * hd ** -0.5 + mask_add
    a = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    return a[0].transpose(0, 1).reshape(T, nh * hd)
