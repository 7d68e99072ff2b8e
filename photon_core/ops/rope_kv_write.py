"""The image-prefix prefill's attention input in one pass: the fused qkv GEMM output of a
chunk of tokens -> the rotated q (for SDPA), the rotated k into the cache and v into the
cache; torch reference and Triton kernel side by side.

    q, = rope_kv_write(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache)

qkv [n, T, (nh + 2 nkv) hd] (rows of the GEMM output, contiguous last dim) at positions
0..T-1; cos / sin [>= T, rot/2] fp32 (rope.rope_angles: the decode step's table, so the
angles are the same floats); k_cache / v_cache [n, nkv, T, hd] (any strides with a
contiguous last dim: kv[i, 0] / kv[i, 1] of the prefix buffer). Returns q [n, T, nh, hd]
contiguous (token-major); SDPA takes q.transpose(1, 2), and its output then has the same
token-major layout, so [n, nh, T, hd] -> [n, T, dim] is a view, not a copy.

Rotation (Moondream's partial interleaved rotary, rope.py's doc): channels d < rot_dim of
each q and k head are read as pairs (re_j = x[j], im_j = x[rot/2 + j]) and written
interleaved, even d = 2j: re_j cos_j - im_j sin_j, odd d = 2j + 1: im_j cos_j + re_j sin_j,
computed in fp32 as x[src_c] * c + x[src_s] * (+-s) exactly as decode_attention's kernel
rotates a new token's k (so a prefix k in the cache is what the decode step would have
written for it), rounded once to the cache dtype; channels d >= rot_dim and v pass through
unchanged. Replaces, per layer: the fp32 cast, two index_select gathers, the multiply-add,
the cast back (ops/rope.rope), and the k / v copies into the cache.

The kernel: one program per (batch row, tokens_per_program tokens, heads_per_program heads of
ONE kind: q, k or v): a [tokens, heads, channels] tile, default 4 x 32 x 64 (16 KB of bf16
read, 16 KB written; the previous kernel moved one token's 4 KB per program and loaded the
rotated channels three times). Each qkv channel is loaded once: the pair halves re / im as two
[tokens, heads, rot/2] tiles, the pass-through channels as a third; the rotated pairs are
interleaved in registers (tl.join + reshape) and stored contiguously. The products are the
decode kernel's (decode_attention.rotary_sources: x[src_c] * c + x[src_s] * s), operand for
operand, so the compiled arithmetic is the same fma (sm_90 PTX: fma(x_c, cos, x_s * s)).
bench/bench_rope_kv_write.py times it against the previous kernel on the GPU.

The reference (`rope_kv_write_reference`) is apply_rope's math (other fp32 rounding of the
products' sum: fp32 values within 1 ulp, bf16 values within 1 bf16 ulp).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .rope import apply_rope


@triton.jit
def _rotate_block(src, s_src_t, dst, s_dst_t, s_dst_h, cos_ptr, sin_ptr, t0, tt, t_ok, hh, ok,
                  HD: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                  PASS_P2: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr):
    """A [TB tokens, HB heads] block of q or k heads: src / dst at its first token and head
    (src rows token-major, heads HD apart); channels < 2 HALF rotated, the rest as they are.
    Each source channel is loaded once: the pair halves re / im as two tiles, the rotated
    pairs interleaved in registers (join + reshape) instead of gathered from memory."""
    t3 = tt[:, None, None]
    h3 = hh[None, :, None]
    src_th = src + t3 * s_src_t + h3 * HD
    dst_th = dst + t3 * s_dst_t + h3 * s_dst_h
    # pair j: re_j = x[j], im_j = x[HALF + j]
    j = tl.arange(0, HALF_P2)
    j_ok = j < HALF
    m = ok & j_ok[None, None, :]
    re = tl.load(src_th + j[None, None, :], mask=m, other=0.0).to(tl.float32)
    im = tl.load(src_th + HALF + j[None, None, :], mask=m, other=0.0).to(tl.float32)
    # the angle table's rows of the block's tokens (masked past T: the table covers T rows)
    tab = (t0 + tt)[:, None, None] * HALF + j[None, None, :]
    tm = t_ok[:, None, None] & j_ok[None, None, :]
    c = tl.load(cos_ptr + tab, mask=tm, other=0.0)
    s = tl.load(sin_ptr + tab, mask=tm, other=0.0)
    # decode_attention.rotary_sources' x[src_c] * c + x[src_s] * s, operand for operand
    # (the same fp32 rounding): even d = 2j: re_j * c + im_j * (-s), odd d = 2j + 1:
    # im_j * c + re_j * s
    even = re * c + im * -s
    odd = im * c + re * s
    # interleave: [.., HALF_P2, 2] -> [.., 2 HALF_P2], output channel 2j (even), 2j + 1 (odd)
    r = tl.reshape(tl.join(even, odd), (TB, HB, 2 * HALF_P2))
    d = tl.arange(0, 2 * HALF_P2)
    tl.store(dst_th + d[None, None, :], r.to(dst.dtype.element_ty),
             mask=ok & (d < 2 * HALF)[None, None, :])
    p = 2 * HALF + tl.arange(0, PASS_P2)
    mp = ok & (p < HD)[None, None, :]
    x = tl.load(src_th + p[None, None, :], mask=mp, other=0.0)
    tl.store(dst_th + p[None, None, :], x.to(dst.dtype.element_ty), mask=mp)


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, s_qkv_b, s_qkv_t, cos_ptr, sin_ptr,
                          q_ptr, s_q_b, s_q_t,
                          k_ptr, s_k_b, s_k_h, s_k_t,
                          v_ptr, s_v_b, s_v_h, s_v_t, T,
                          NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                          HD_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                          PASS_P2: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr):
    # program -> (batch row b, block of TB tokens from t0, block of HB head slots of one
    # kind: q heads, k heads or v heads). The slot blocks of a token block are consecutive
    # programs: they read the same qkv rows at about the same time.
    QB: tl.constexpr = (NH + HB - 1) // HB
    KB: tl.constexpr = (NKV + HB - 1) // HB
    SB: tl.constexpr = QB + 2 * KB
    pid = tl.program_id(0)
    blk = pid % SB
    row = pid // SB                                       # b * cdiv(T, TB) + token block
    nt = tl.cdiv(T, TB)
    b = (row // nt).to(tl.int64)
    t0 = (row % nt).to(tl.int64) * TB
    tt = tl.arange(0, TB)
    t_ok = (t0 + tt) < T
    hh = tl.arange(0, HB)
    src = qkv_ptr + b * s_qkv_b + t0 * s_qkv_t            # the block's first qkv row
    if blk < QB:
        h0 = blk * HB
        ok = (t_ok[:, None] & (h0 + hh < NH)[None, :])[:, :, None]
        _rotate_block(src + h0 * HD, s_qkv_t, q_ptr + b * s_q_b + t0 * s_q_t + h0 * HD,
                      s_q_t, HD, cos_ptr, sin_ptr, t0, tt, t_ok, hh, ok,
                      HD, HALF, HALF_P2, PASS_P2, TB, HB)
    elif blk < QB + KB:
        h0 = (blk - QB) * HB
        ok = (t_ok[:, None] & (h0 + hh < NKV)[None, :])[:, :, None]
        _rotate_block(src + (NH + h0) * HD, s_qkv_t,
                      k_ptr + b * s_k_b + t0 * s_k_t + h0 * s_k_h, s_k_t, s_k_h,
                      cos_ptr, sin_ptr, t0, tt, t_ok, hh, ok,
                      HD, HALF, HALF_P2, PASS_P2, TB, HB)
    else:
        # v heads: the rows as they are
        h0 = (blk - QB - KB) * HB
        ok = (t_ok[:, None] & (h0 + hh < NKV)[None, :])[:, :, None]
        d = tl.arange(0, HD_P2)
        m = ok & (d < HD)[None, None, :]
        t3 = tt[:, None, None]
        h3 = hh[None, :, None]
        x = tl.load(src + (NH + NKV + h0) * HD + t3 * s_qkv_t + h3 * HD + d[None, None, :],
                    mask=m, other=0.0)
        dst = v_ptr + b * s_v_b + t0 * s_v_t + h0 * s_v_h
        tl.store(dst + t3 * s_v_t + h3 * s_v_h + d[None, None, :],
                 x.to(v_ptr.dtype.element_ty), mask=m)


def _check(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache):
    n, t, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv_heads)
    if hd * (n_heads + 2 * n_kv_heads) != width:
        raise ValueError(f"qkv width {width} is not (nh + 2 nkv) * head_dim")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(c.shape) != (n, n_kv_heads, t, hd) or c.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(c.shape)} is not [{n}, {n_kv_heads}, {t}, {hd}] "
                             "with a contiguous last dim")
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] < t or 2 * half > hd:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not cover {t} positions of head {hd}")
    return n, t, hd, half


def rope_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            n_heads: int, n_kv_heads: int, k_cache: torch.Tensor,
                            v_cache: torch.Tensor) -> torch.Tensor:
    """The op in torch (apply_rope, as text.decoder): returns q [n, T, nh, hd]."""
    n, t, hd, _ = _check(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache)
    q, k, v = qkv.split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], dim=-1)
    c, s = cos[:t], sin[:t]
    q = apply_rope(q.reshape(n, t, n_heads, hd).transpose(1, 2), c, s)
    k_cache.copy_(apply_rope(k.reshape(n, t, n_kv_heads, hd).transpose(1, 2), c, s))
    v_cache.copy_(v.reshape(n, t, n_kv_heads, hd).transpose(1, 2))
    return q.transpose(1, 2).contiguous()


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                  n_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  heads_per_program: int = 32, tokens_per_program: int = 4,
                  num_warps: int = 4) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1): one program per
    (tokens_per_program tokens, heads_per_program heads of one kind: q, k or v). Returns
    q [n, T, nh, hd]."""
    n, t, hd, half = _check(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache)
    if tokens_per_program < 1 or heads_per_program < 1:
        raise ValueError(f"tokens_per_program {tokens_per_program} and heads_per_program "
                         f"{heads_per_program} must be >= 1")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q = torch.empty(n, t, n_heads, hd, device=qkv.device, dtype=qkv.dtype)
    hb = min(triton.next_power_of_2(max(n_heads, n_kv_heads)),
             triton.next_power_of_2(heads_per_program))
    tb = triton.next_power_of_2(tokens_per_program)
    slot_blocks = triton.cdiv(n_heads, hb) + 2 * triton.cdiv(n_kv_heads, hb)
    if n * t:
        _rope_kv_write_kernel[(n * triton.cdiv(t, tb) * slot_blocks,)](
            qkv, qkv.stride(0), qkv.stride(1), cos, sin,
            q, q.stride(0), q.stride(1),
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), t,
            NH=n_heads, NKV=n_kv_heads, HD=hd, HD_P2=triton.next_power_of_2(hd), HALF=half,
            HALF_P2=triton.next_power_of_2(max(half, 1)),
            PASS_P2=triton.next_power_of_2(max(hd - 2 * half, 1)),
            TB=tb, HB=hb, num_warps=num_warps)
    return q


__all__ = ["rope_kv_write", "rope_kv_write_reference"]
