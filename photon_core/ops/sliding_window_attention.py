"""Causal attention with an optional sliding window over a k/v cache kept at full length
(a masked window: key j is seen from query position p iff p - window < j <= p).

window=None is plain causal (Gemma 4's global layers); window=W the sliding layers (a query
sees itself and the W - 1 positions before it, as transformers' sliding_window_overlay).
GQA: query head h reads k/v head h // (Hq / Hkv). Scores are q.k * scale (Gemma 4: 1.0),
softmax in fp32.

- `attention_mask` / `window_attention`: the reference for a block of queries (prefill), with
  optional `blocks` (block id per position, -1 = none): positions of the same block also see
  each other both ways (Gemma 4's bidirectional image tokens), still within the window.
- `sliding_window_decode`: one new query per head; reads only cache[:, start:pos+1].
  `sliding_window_decode_triton` is its Triton kernel (one program per query head, online
  softmax over blocks of the window), diff-tested in fp32 under TRITON_INTERPRET=1.

The state cache's forms (the step program's window_attention op, models/gemma4/program.py):
rows of a batch at their own positions over per-row state [rows, Hkv, S, D] that is either
a RING of S = window slots (position p in slot p % S: a sliding layer keeps only its window)
or full length with the window as a mask.
- `rows_decode_reference` / `rows_decode_triton`: one query per row (b rows, device
  positions: graph-capturable); the kernel is one program per (row, k/v head), or with few
  of those (SPLIT_BELOW) per (row, k/v head, tile of slots) plus a merge.
- `prefill_keys` + `prefill_attention`: a prompt chunk of one row: its k/v into the state
  (a ring keeps the chunk's last S), and the view of keys it attends to (the ring's older
  positions + the chunk's own); KV-shared layers attend to their source layer's view.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:          # pragma: no cover - the reference needs no triton
    triton = None


def window_start(pos: int, window: int | None) -> int:
    return 0 if window is None else max(0, pos - window + 1)


def attention_mask(q_pos: torch.Tensor, kv_len: int, window: int | None,
                   blocks: torch.Tensor | None = None) -> torch.Tensor:
    """bool [S, kv_len]: True where query i (at absolute position q_pos[i]) sees key j."""
    j = torch.arange(kv_len, device=q_pos.device)[None, :]
    p = q_pos[:, None]
    seen = j <= p
    if blocks is not None:
        bq, bk = blocks[q_pos][:, None], blocks[:kv_len][None, :]
        seen = seen | ((bq == bk) & (bq >= 0))
    if window is not None:
        seen = seen & (j > p - window)
    return seen


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     window: int | None, scale: float,
                     blocks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, S, D], k/v [Hkv, T, D] (T = valid length) -> [Hq, S, D]."""
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    scores = (q @ k.transpose(1, 2)) * scale
    mask = attention_mask(q_pos, k.shape[1], window, blocks)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


def window_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_pos: torch.Tensor, window: int | None, scale: float,
                          blocks: torch.Tensor | None = None) -> torch.Tensor:
    """window_attention through F.scaled_dot_product_attention with its boolean mask (a
    fused kernel on the GPU where one takes the mask and head size - memory-efficient or
    cuDNN -, the math form elsewhere): the same math, not the same bits (the fast encode's
    prefix pass). Every query sees at least its own key, so no row is fully masked."""
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    mask = attention_mask(q_pos, k.shape[1], window, blocks)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None],
                                          scale=scale)[0]


def sliding_window_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          pos: int, window: int | None, scale: float) -> torch.Tensor:
    """Reference. q [Hq, D]; caches [Hkv, capacity, D] holding positions 0..pos -> [Hq, D]."""
    start = window_start(pos, window)
    k, v = k_cache[:, start:pos + 1], v_cache[:, start:pos + 1]
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    scores = torch.einsum("hd,htd->ht", q, k) * scale
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("ht,htd->hd", probs, v)


if triton is not None:
    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start, end, scale,
                       stride_kh, stride_kt, rep,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        h = tl.program_id(0)
        kvh = h // rep
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + h * D + d, mask=dmask, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            offs = kvh * stride_kh + t[:, None] * stride_kt + d[None, :]
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(tmask, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l = l * alpha + tl.sum(p, axis=0)
            m = m_new
        tl.store(o_ptr + h * D + d, (acc / l).to(o_ptr.dtype.element_ty), mask=dmask)


def sliding_window_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 pos: int, window: int | None, scale: float,
                                 block_n: int = 64) -> torch.Tensor:
    """Triton kernel of `sliding_window_decode` (same arguments, same result)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    hq, d = q.shape
    assert k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride() and q.is_contiguous()
    out = torch.empty_like(q)
    _decode_kernel[(hq,)](q, k_cache, v_cache, out, window_start(pos, window), pos + 1,
                          float(scale), k_cache.stride(0), k_cache.stride(1),
                          hq // k_cache.shape[0], D=d, BLOCK_D=triton.next_power_of_2(d),
                          BLOCK_N=block_n)
    return out


# -- the state cache's forms: batch rows at their own positions, ring or masked window -------
# A layer's state row is [Hkv, S, D]. ring=True (sliding layers): S = window slots, position
# p lives in slot p % S, so a row keeps exactly its last S positions and slot s holds a valid
# key for a query at p iff s <= p (before the ring is full only slots 0..p were written;
# after, every slot is within the window). ring=False: S = capacity, position p at slot p,
# the window (if any) a mask on read.
def state_slot(pos: torch.Tensor, n_slots: int, ring: bool) -> torch.Tensor:
    return torch.remainder(pos, n_slots) if ring else pos


def rows_decode_valid(pos: torch.Tensor, n_slots: int, window: int | None,
                      ring: bool) -> torch.Tensor:
    """bool [b, n_slots]: slot s of row i holds a key the query at pos[i] sees."""
    s = torch.arange(n_slots, device=pos.device)[None, :]
    valid = s <= pos[:, None]
    if window is not None and not ring:
        valid = valid & (s > pos[:, None] - window)
    return valid


def rows_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          rows: torch.Tensor, pos: torch.Tensor, window: int | None,
                          ring: bool, scale: float, attn_len: int | None = None) -> torch.Tensor:
    """Reference. q [b, Hq, D]; caches [R, Hkv, S, D] holding each row's keys up to and
    including pos [b] (the new k/v already written); rows [b]; attn_len bounds the slots a
    full-length layer reads. -> [b, Hq, D]."""
    n = k_cache.shape[2] if (ring or attn_len is None) else min(attn_len, k_cache.shape[2])
    k, v = k_cache[rows, :, :n], v_cache[rows, :, :n]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q, k) * scale
    valid = rows_decode_valid(pos, n, window, ring)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bht,bhtd->bhd", probs, v)


def prefill_keys(k: torch.Tensor, v: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor,
                 start: int, ring: bool):
    """A prompt chunk's k, v [T, Hkv, D] (positions start..start+T-1) into one row's state
    k_row, v_row [Hkv, S, D] (in place; a ring keeps the chunk's last S positions) -> the keys
    the chunk's queries attend to: (keys, values [Hkv, n, D], their positions [n], valid
    [n]). For a ring: the positions before the chunk from the ring, then the chunk's own (a
    KV-shared layer attends to this same view of its source layer)."""
    T, S, dev = k.shape[0], k_row.shape[1], k.device
    qpos = start + torch.arange(T, device=dev)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if not ring:
        k_row[:, start:start + T] = kt
        v_row[:, start:start + T] = vt
        return (k_row[:, :start + T], v_row[:, :start + T],
                torch.arange(start + T, device=dev),
                torch.ones(start + T, dtype=torch.bool, device=dev))
    s = torch.arange(S, device=dev)
    old_pos = (start - 1) - torch.remainder(start - 1 - s, S)
    view = (torch.cat([k_row, kt], dim=1), torch.cat([v_row, vt], dim=1),
            torch.cat([old_pos, qpos]),
            torch.cat([old_pos >= 0, torch.ones(T, dtype=torch.bool, device=dev)]))
    keep = min(T, S)
    slots = torch.remainder(qpos[T - keep:], S)
    k_row[:, slots] = kt[:, T - keep:]
    v_row[:, slots] = vt[:, T - keep:]
    return view


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      kpos: torch.Tensor, kvalid: torch.Tensor, start: int,
                      window: int | None, scale: float) -> torch.Tensor:
    """Reference. q [T, Hq, D] at positions start.. over keys/values [Hkv, n, D] at
    positions kpos [n] (valid [n]): causal, within the window. -> [T, Hq, D]."""
    qpos = start + torch.arange(q.shape[0], device=q.device)
    return attend_at_positions(q, keys, values, kpos, kvalid, qpos, window, scale)


def attend_at_positions(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        kpos: torch.Tensor, kvalid: torch.Tensor, qpos: torch.Tensor,
                        window: int | None, scale: float) -> torch.Tensor:
    """Reference. q [T, Hq, D] at positions qpos [T] over keys/values [Hkv, n, D] at
    positions kpos [n] (valid [n]): causal, within the window. -> [T, Hq, D]."""
    seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
    if window is not None:
        seen = seen & (kpos[None, :] > qpos[:, None] - window)
    rep = q.shape[1] // keys.shape[0]
    keys = keys.repeat_interleave(rep, dim=0)
    values = values.repeat_interleave(rep, dim=0)
    scores = torch.einsum("thd,hsd->hts", q, keys) * scale
    scores = scores.masked_fill(~seen[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hts,hsd->thd", probs, values)


if triton is not None:
    @triton.jit
    def _rows_attend(q, k_ptr, v_ptr, row, g, t_lo, t_hi, scale, stride_kr, stride_kh,
                     stride_kt, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
        """Online softmax of the query heads q [BLOCK_R, BLOCK_D] over slots [t_lo, t_hi) of
        k/v head g of `row`: -> (m, l, acc) (m = -inf, l = acc = 0 for an empty range)."""
        d = tl.arange(0, BLOCK_D)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for t0 in range(t_lo, t_hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < t_hi
            offs = row * stride_kr + g * stride_kh + t[:, None] * stride_kt + d[None, :]
            kv_mask = tmask[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(tmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l = l * alpha + tl.sum(pr, axis=1)
            m = m_new
        return m, l, acc

    from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

    @triton.jit
    def _rows_query(q_ptr, i, g, stride_qb, rep, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_R: tl.constexpr):
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        qh = g * rep + r
        qmask = (r < rep)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + i * stride_qb + qh[:, None] * D + d[None, :], mask=qmask, other=0.0)
        return q, qh, qmask

    @triton.jit
    def _rows_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, rows_ptr, pos_ptr, n_slots, window,
                            scale, stride_qb, stride_ob, stride_kr, stride_kh, stride_kt, rep,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        i = tl.program_id(0)
        g = tl.program_id(1)                     # the k/v head: its `rep` query heads at once
        row = tl.load(rows_ptr + i)
        p = tl.load(pos_ptr + i)
        q, qh, qmask = _rows_query(q_ptr, i, g, stride_qb, rep, D, BLOCK_D, BLOCK_R)
        lo = tl.maximum(p - window + 1, 0)      # a masked window's first slot (else 0)
        hi = tl.minimum(p + 1, n_slots)
        m, l, acc = _rows_attend(q, k_ptr, v_ptr, row, g, lo, hi, scale, stride_kr, stride_kh,
                                 stride_kt, D, BLOCK_D, BLOCK_N, BLOCK_R, IEEE)
        d = tl.arange(0, BLOCK_D)
        tl.store(o_ptr + i * stride_ob + qh[:, None] * D + d[None, :],
                 (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def _rows_decode_split_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, rows_ptr,
                                  pos_ptr, n_slots, window, scale, stride_qb, stride_kr,
                                  stride_kh, stride_kt, rep, hq, chunk,
                                  D: tl.constexpr, BLOCK_D: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                                  IEEE: tl.constexpr, GDC: tl.constexpr = False):
        """Program (row, k/v head, split): the split's `chunk` slots of the row's range ->
        softmax partials per query head at [(i * hq + head) * n_split + split]."""
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        i = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        n_split = tl.num_programs(2)
        row = tl.load(rows_ptr + i)
        p = tl.load(pos_ptr + i)
        q, qh, qmask = _rows_query(q_ptr, i, g, stride_qb, rep, D, BLOCK_D, BLOCK_R)
        lo = tl.maximum(p - window + 1, 0) + sp * chunk
        hi = tl.minimum(tl.minimum(p + 1, n_slots), lo + chunk)
        m, l, acc = _rows_attend(q, k_ptr, v_ptr, row, g, lo, hi, scale, stride_kr, stride_kh,
                                 stride_kt, D, BLOCK_D, BLOCK_N, BLOCK_R, IEEE)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        idx = (i * hq + qh) * n_split + sp
        tl.store(m_ptr + idx, m, mask=r < rep)
        tl.store(l_ptr + idx, l, mask=r < rep)
        tl.store(acc_ptr + idx[:, None] * D + d[None, :], acc, mask=qmask)

    @triton.jit
    def _rows_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, stride_ob, hq, n_split,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_P2: tl.constexpr,
                             GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        i = tl.program_id(0)
        h = tl.program_id(1)
        sidx = tl.arange(0, SPLIT_P2)
        sok = sidx < n_split
        base = (i * hq + h) * n_split
        m = tl.load(m_ptr + base + sidx, mask=sok, other=float("-inf"))
        l = tl.load(l_ptr + base + sidx, mask=sok, other=0.0)
        mx = tl.max(m, axis=0)
        wt = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (base + sidx[:, None]) * D + d[None, :],
                      mask=sok[:, None] & (d < D)[None, :], other=0.0)
        o = tl.sum(acc * wt[:, None], axis=0) / tl.sum(l * wt, axis=0)
        tl.store(o_ptr + i * stride_ob + h * D + d, o.to(o_ptr.dtype.element_ty), mask=d < D)


# below this many (row, k/v head) programs, rows_decode_triton splits each row's slots over
# programs (flash-decoding) and merges them in a second launch: Gemma 4 E2B has ONE k/v head,
# so one program per row walked a layer's whole window (12 us per layer at b = 1 on the
# H200, docs/benchmarks.md session 10 call 11). 0: never split.
SPLIT_BELOW = 64


def rows_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       rows: torch.Tensor, pos: torch.Tensor, window: int | None, ring: bool,
                       scale: float, out: torch.Tensor, attn_len: int | None = None,
                       block_n: int = 64, split: bool | None = None, pdl: bool = False
                       ) -> torch.Tensor:
    """Triton kernel of `rows_decode_reference`: q [b, Hq * D] (row stride free), out the
    same shape; one program per (row, k/v head): its query heads share each k/v tile (two
    tl.dot per tile, the heads padded to 16), online softmax over the row's slots (a ring's
    S slots; a full-length layer's window only). Positions and rows are device tensors.
    split (None: when b x Hkv < SPLIT_BELOW): one program per (row, k/v head, tile of
    block_n slots of the row's range), softmax partials merged by a second kernel.
    pdl: programmatic dependent launch (ops/pdl.py)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    b = q.shape[0]
    hkv, S, d = k_cache.shape[1:]
    hq = q.shape[1] // d
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    assert q.stride(1) == 1 and out.stride(1) == 1
    n = S if (ring or attn_len is None) else min(attn_len, S)
    masked = window is not None and not ring
    span = min(n, window) if masked else n
    block_n = max(16, min(block_n, triton.next_power_of_2(span)))
    block_d = max(16, triton.next_power_of_2(d))
    block_n, stages, warps = rows_decode_launch(block_d, k_cache.element_size(), block_n)
    args = (rows, pos, n, window if masked else 1 << 30, float(scale), q.stride(0))
    _, gdc, launch_kw = pdl_launch(pdl, q)
    kw = dict(D=d, BLOCK_D=block_d, BLOCK_N=block_n,
              BLOCK_R=max(16, triton.next_power_of_2(hq // hkv)),
              IEEE=q.dtype == torch.float32, num_warps=warps, GDC=gdc, **launch_kw)
    if split is None:
        split = b * hkv < SPLIT_BELOW
    if not split:
        _rows_decode_kernel[(b, hkv)](
            q, k_cache, v_cache, out, *args, out.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), hq // hkv, num_stages=stages, **kw)
        return out
    n_split = triton.cdiv(span, block_n)
    m = torch.empty(b * hq * n_split, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(b * hq * n_split * d, device=q.device, dtype=torch.float32)
    _rows_decode_split_kernel[(b, hkv, n_split)](
        q, k_cache, v_cache, m, l, acc, *args, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), hq // hkv, hq, block_n, num_stages=stages, **kw)
    _rows_combine_kernel[(b, hq)](m, l, acc, out, out.stride(0), hq, n_split, D=d,
                                  BLOCK_D=block_d, SPLIT_P2=triton.next_power_of_2(n_split),
                                  num_warps=4, GDC=gdc, **launch_kw)
    return out


# what the k/v tiles in flight may take of a block's shared memory (sm_90 has 227 KB; the
# kernel's own scratch comes on top: ~18 KB at D = 512)
ROWS_DECODE_SMEM_BUDGET = 160 * 1024


def rows_decode_launch(block_d: int, elem: int, block_n: int = 64) -> tuple[int, int, int]:
    """(BLOCK_N, num_stages, num_warps) of `_rows_decode_kernel` for a head of block_d
    channels of `elem` bytes: the software pipeline keeps (stages - 1) k and v tiles of
    [BLOCK_N, block_d] in shared memory, so wide heads (Gemma 4's global 512) or fp32 get
    fewer stages, then narrower key tiles, to stay within ROWS_DECODE_SMEM_BUDGET; 8 warps
    once a row of the tile is over 512 bytes (fewer registers per thread: no spills).
    Checked by compiling for sm_90 on the CPU (test_gemma4_ops.py, ops/launch_resources)."""
    warps = 4 if block_d * elem <= 512 else 8
    while True:
        for stages in (3, 2, 1):
            if max(stages - 1, 1) * block_n * block_d * elem * 2 <= ROWS_DECODE_SMEM_BUDGET:
                return block_n, stages, warps
        if block_n <= 16:
            return block_n, 1, warps
        block_n //= 2
