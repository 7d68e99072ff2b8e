"""Causal grouped-query attention of new tokens over a k/v cache (reference).

q [Hq, T, D] are the T newest positions start .. start+T-1; k, v [Hkv, S, D] hold positions
0 .. S-1 with S = start + T (the new ones included). Each of the Hkv k/v heads serves Hq/Hkv
consecutive query heads. Softmax in fp32; scale D^-0.5.
"""
from __future__ import annotations

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    hq, t, d = q.shape
    hkv, s, _ = k.shape
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    scores = (q.float() @ k.float().transpose(-1, -2)) * d ** -0.5          # [Hq, T, S]
    qpos = torch.arange(start, start + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)                      # [Hq, T, D]


def gated_gqa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """One new token (the attention of a decode step): q [Hq, D] at position length-1 over the
    cache k, v [Hkv, >= length, D] -> [Hq, D] in q's dtype, times sigmoid(gate [Hq, D]) if
    given (Qwen 3.5's output gate)."""
    o = gqa_attention(q[:, None], k[:, :length], v[:, :length], length - 1)[:, 0]
    return o if gate is None else o * torch.sigmoid(gate)


# -- Triton: split-sequence ("flash-decoding") attention of one token, with the output gate ------
# Phase 1, grid (Hq, splits): program (h, s) runs an online softmax over its span of the cache
# (tiles of BS positions of k/v head h // (Hq/Hkv)) and writes its partial max m, sum l and
# unnormalised output acc [D] (fp32). Phase 2, grid (Hq,): combines the splits
# (sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s), multiplies by sigmoid(gate) and stores.
# Splitting the sequence keeps the GPU busy when Hq is small (8 query heads at 0.8B). With the
# length given as a device tensor the launch depends only on the cache capacity (splits past
# the length are empty and weigh 0), so one launch serves every step (CUDA-graph friendly).
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    @triton.jit
    def _span_softmax(q, kb, vb, sk_s, sv_s, lo, hi, d, dm, BS: tl.constexpr, BD: tl.constexpr,
                      CM: tl.constexpr):
        """Online softmax of one (pre-scaled) query q [BD] over keys / values at kb / vb,
        positions lo .. hi-1 in tiles of BS -> (m, l, acc): the split's running max, sum and
        weighted values (fp32; m = -inf for an empty span). CM: the k / v loads' cache
        modifier (".cg" where another SM wrote them during the launch: the megakernel)."""
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BD], tl.float32)
        for t0 in range(lo, hi, BS):
            pos = t0 + tl.arange(0, BS)
            pm = pos < hi
            msk = pm[:, None] & dm[None, :]
            kt = tl.load(kb + pos[:, None] * sk_s + d[None, :], mask=msk, other=0.0,
                         cache_modifier=CM).to(tl.float32)
            s = tl.sum(kt * q[None, :], axis=1)
            s = tl.where(pm, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            vt = tl.load(vb + pos[:, None] * sv_s + d[None, :], mask=msk, other=0.0,
                         cache_modifier=CM).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
            m = m_new
        return m, l, acc

    @triton.jit
    def _merge_splits(m, l, acc):
        """The splits' partials (m, l [NS], acc [NS, BD]) -> the attention output [BD]."""
        mx = tl.max(m, axis=0)
        wt = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)     # empty splits weigh 0
        return tl.sum(wt[:, None] * acc, axis=0) / tl.sum(wt * l, axis=0)

if triton is not None:
    @triton.jit
    def _decode_attn_split_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, len_ptr, S, CAP,
                                  SPLIT, D, scale, sq, sk_h, sk_s, sv_h, sv_s, NS,
                                  LEN_PTR: tl.constexpr, REP: tl.constexpr, BS: tl.constexpr,
                                  BD: tl.constexpr):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        if LEN_PTR:
            S = tl.minimum(tl.load(len_ptr).to(tl.int32), CAP)
        kvh = h // REP
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + h * sq + d, mask=dm, other=0.0).to(tl.float32) * scale
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, S)
        m, l, acc = _span_softmax(q, k_ptr + kvh * sk_h, v_ptr + kvh * sv_h, sk_s, sv_s, lo, hi,
                                  d, dm, BS, BD, "")
        tl.store(m_ptr + h * NS + sp, m)
        tl.store(l_ptr + h * NS + sp, l)
        tl.store(acc_ptr + (h * NS + sp) * D + d, acc, mask=dm)

    @triton.jit
    def _decode_attn_combine_kernel(m_ptr, l_ptr, acc_ptr, g_ptr, o_ptr, NS, D, sg, so,
                                    HAS_GATE: tl.constexpr, NS_P2: tl.constexpr,
                                    BD: tl.constexpr):
        h = tl.program_id(0)
        s = tl.arange(0, NS_P2)
        sm = s < NS
        d = tl.arange(0, BD)
        dm = d < D
        m = tl.load(m_ptr + h * NS + s, mask=sm, other=float("-inf"))
        l = tl.load(l_ptr + h * NS + s, mask=sm, other=0.0)
        acc = tl.load(acc_ptr + (h * NS + s)[:, None] * D + d[None, :],
                      mask=sm[:, None] & dm[None, :], other=0.0)
        o = _merge_splits(m, l, acc)
        if HAS_GATE:
            g = tl.load(g_ptr + h * sg + d, mask=dm, other=0.0).to(tl.float32)
            o = o / (1.0 + tl.exp(-g))
        tl.store(o_ptr + h * so + d, o.to(o_ptr.dtype.element_ty), mask=dm)


def gated_gqa_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            length: int | torch.Tensor, gate: torch.Tensor | None = None,
                            num_splits: int | None = None, block_s: int | None = None
                            ) -> torch.Tensor:
    """Same contract as gated_gqa_decode. k, v may be strided cache tensors [Hkv, cap, D] (unit
    last stride). num_splits None: enough splits for ~128 programs (at least one tile each).
    length may be a one-element integer tensor on q's device: then it is read by the kernel
    (no host sync), the splits are planned over the capacity, and a value past the capacity
    is clamped to it (a length < 1 gives NaN rows; the caller keeps it in 1..capacity)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    hq, d = q.shape
    hkv, cap = k.shape[0], k.shape[1]
    on_device = isinstance(length, torch.Tensor)
    if on_device and (length.numel() != 1 or length.is_floating_point()
                      or length.device != q.device):
        raise ValueError("a tensor length must be one integer on q's device")
    plan = cap if on_device else length
    if hq % hkv or k.shape[2] != d or v.shape != k.shape or not 0 < plan <= cap:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"length {length} do not fit")
    if gate is not None and gate.shape != (hq, d):
        raise ValueError(f"gate shape {tuple(gate.shape)} != {(hq, d)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    bd = triton.next_power_of_2(d)
    bs = block_s or max(16, min(64, 8192 // bd))
    tiles = triton.cdiv(plan, bs)
    ns = num_splits or max(1, min(tiles, 128 // hq))
    ns = min(ns, tiles)
    split = triton.cdiv(tiles, ns) * bs                   # positions per split, whole tiles
    ns = triton.cdiv(plan, split)
    dev = q.device
    m = torch.empty(hq, ns, dtype=torch.float32, device=dev)
    l = torch.empty(hq, ns, dtype=torch.float32, device=dev)
    acc = torch.empty(hq, ns, d, dtype=torch.float32, device=dev)
    _decode_attn_split_kernel[(hq, ns)](
        q, k, v, m, l, acc, length if on_device else q, 0 if on_device else length, cap, split,
        d, d ** -0.5, q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), ns,
        LEN_PTR=on_device, REP=hq // hkv, BS=bs, BD=bd)
    out = torch.empty(hq, d, dtype=q.dtype, device=dev)
    _decode_attn_combine_kernel[(hq,)](
        m, l, acc, gate if gate is not None else out, out, ns, d,
        gate.stride(0) if gate is not None else 0, out.stride(0), HAS_GATE=gate is not None,
        NS_P2=triton.next_power_of_2(ns), BD=bd)
    return out


# -- Triton: split-sequence gated attention over a decode bucket's rows -------------------------
# Phase 1, grid (b, Hq, splits): program (r, h, s) runs the online softmax of row r's query head
# h over its span of the row's cache (k/v head h // (Hq/Hkv) of slot r), up to the row's length
# min(pos[r] + 1, attn_len) read on the device, and writes its partial m, l, acc (fp32) into
# the scratch. Phase 2, grid (b, Hq): combines the splits, multiplies by sigmoid(gate) and
# stores into the output view. The split plan depends only on attn_len (fixed per graph), so
# one launch pair serves every step; splits past a row's length are empty and weigh 0.
if triton is not None:
    from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

    @triton.jit
    def _gqa_rows_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, ATTN,
                               SPLIT, D, scale, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                               HQ, NS, REP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
                               GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.minimum(tl.load(pos_ptr + r) + 1, ATTN).to(tl.int32)
        kvh = h // REP
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + r * sq_b + h * sq_h + d, mask=dm, other=0.0).to(tl.float32) * scale
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, length)
        kb = k_ptr + r * sk_b + kvh * sk_h
        vb = v_ptr + r * sv_b + kvh * sv_h
        m, l, acc = _span_softmax(q, kb, vb, sk_s, sv_s, lo, hi, d, dm, BS, BD, "")
        i = (r * HQ + h) * NS + sp
        tl.store(m_ptr + i, m)
        tl.store(l_ptr + i, l)
        tl.store(acc_ptr + i * D + d, acc, mask=dm)

    @triton.jit
    def _gqa_rows_combine_kernel(m_ptr, l_ptr, acc_ptr, g_ptr, o_ptr, HQ, NS, D, sg_b, sg_h,
                                 so_b, so_h, NS_P2: tl.constexpr, BD: tl.constexpr,
                                 GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, NS_P2)
        sm = s < NS
        d = tl.arange(0, BD)
        dm = d < D
        base = (r * HQ + h) * NS
        m = tl.load(m_ptr + base + s, mask=sm, other=float("-inf"))
        l = tl.load(l_ptr + base + s, mask=sm, other=0.0)
        acc = tl.load(acc_ptr + (base + s)[:, None] * D + d[None, :],
                      mask=sm[:, None] & dm[None, :], other=0.0)
        o = _merge_splits(m, l, acc)
        g = tl.load(g_ptr + r * sg_b + h * sg_h + d, mask=dm, other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-g))
        tl.store(o_ptr + r * so_b + h * so_h + d, o.to(o_ptr.dtype.element_ty), mask=dm)


class RowsAttentionScratch:
    """The split plan and fp32 partials of gated_gqa_decode_rows_triton for up to `rows` rows
    over up to `attn_len` positions (allocated once: graph-capturable)."""

    def __init__(self, rows: int, n_heads: int, head_dim: int, attn_len: int, device,
                 block_s: int | None = None, programs: int | None = None):
        bd = triton.next_power_of_2(head_dim)
        self.block_s = bs = block_s or max(16, min(64, 8192 // bd))
        tiles = triton.cdiv(attn_len, bs)
        # ~`programs` programs at batch 1 (the bucket's rows add more); default: 256 on a GPU,
        # one split per head elsewhere (the CPU's interpreter runs programs one by one)
        if programs is None:
            programs = 256 if torch.device(device).type == "cuda" else n_heads
        ns = max(1, min(tiles, programs // n_heads))
        self.split = triton.cdiv(tiles, ns) * bs
        self.n_splits = ns = triton.cdiv(attn_len, self.split)
        self.attn_len, self.rows, self.n_heads, self.head_dim = attn_len, rows, n_heads, head_dim
        self.m = torch.empty(rows, n_heads, ns, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, n_heads, ns, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows, n_heads, ns, head_dim, dtype=torch.float32, device=device)


def gated_gqa_decode_rows_triton(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                                 pos: torch.Tensor, attn_len: int, gate: torch.Tensor,
                                 out: torch.Tensor | None = None,
                                 scratch: RowsAttentionScratch | None = None,
                                 pdl: bool = False) -> torch.Tensor:
    """A decode step over rows 0 .. b-1 (the attention part of
    gated_attention.gated_attention_rows): q [b, Hq, D] (normed, rotated), kc, vc [>= b, Hkv,
    capacity, D] (row r in slot r, its new k/v already written), pos [b] int on q's device
    (row r attends over positions 0 .. min(pos[r], attn_len - 1)), gate [b, Hq, D] (any row /
    head strides) -> out [b, Hq, D] (or a strided view; new when None) = softmax(q k^T / sqrt
    D) v * sigmoid(gate). scratch: a RowsAttentionScratch for >= b rows and this attn_len."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, hq, d = q.shape
    hkv, cap = kc.shape[1], kc.shape[2]
    if hq % hkv or kc.shape[0] < b or kc.shape[3] != d or vc.shape != kc.shape or \
            not 0 < attn_len <= cap or gate.shape != (b, hq, d) or pos.shape != (b,):
        raise ValueError(f"gated_gqa_decode_rows_triton: shapes q {tuple(q.shape)}, kc "
                         f"{tuple(kc.shape)}, gate {tuple(gate.shape)}, pos {tuple(pos.shape)}, "
                         f"attn_len {attn_len} do not fit")
    if any(t.stride(-1) != 1 for t in (q, kc, vc, gate)):
        raise ValueError("q, kc, vc, gate need a unit last stride")
    if scratch is None:
        scratch = RowsAttentionScratch(b, hq, d, attn_len, q.device)
    elif scratch.rows < b or scratch.n_heads != hq or scratch.head_dim != d or \
            scratch.attn_len != attn_len:
        raise ValueError("the scratch was planned for other shapes")
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    elif out.shape != (b, hq, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {hq}, {d}] with unit last stride")
    ns, bd = scratch.n_splits, triton.next_power_of_2(d)
    _, gdc, launch_kw = pdl_launch(pdl, q)      # (pdl: ops/pdl.py)
    _gqa_rows_split_kernel[(b, hq, ns)](
        q, kc, vc, pos, scratch.m, scratch.l, scratch.acc, attn_len, scratch.split, d,
        d ** -0.5, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), hq, ns, REP=hq // hkv, BS=scratch.block_s,
        BD=bd, GDC=gdc, **launch_kw)
    _gqa_rows_combine_kernel[(b, hq)](
        scratch.m, scratch.l, scratch.acc, gate, out, hq, ns, d, gate.stride(0),
        gate.stride(1), out.stride(0), out.stride(1), NS_P2=triton.next_power_of_2(ns), BD=bd,
        GDC=gdc, **launch_kw)
    return out
