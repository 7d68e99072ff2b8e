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
"""
from __future__ import annotations

import torch

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
