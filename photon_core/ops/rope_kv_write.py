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

The reference (`rope_kv_write_reference`) is apply_rope's math (other fp32 rounding of the
products' sum: fp32 values within 1 ulp, bf16 values within 1 bf16 ulp).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .rope import apply_rope
from .decode_attention import rotary_sources


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, s_qkv_b, s_qkv_t, cos_ptr, sin_ptr,
                          q_ptr, s_q_b, s_q_t,
                          k_ptr, s_k_b, s_k_h, s_k_t,
                          v_ptr, s_v_b, s_v_h, s_v_t, T,
                          NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                          HD_P2: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)          # b * T + t
    b = row // T
    t = row % T
    j = tl.program_id(1) * HB + tl.arange(0, HB)  # head slot: q heads, then k, then v
    d = tl.arange(0, HD_P2)
    n_slots: tl.constexpr = NH + 2 * NKV
    slot_ok = j < n_slots
    d_ok = d < HD
    ok = slot_ok[:, None] & d_ok[None, :]
    # the decode kernel's source channels and factors (decode_attention.rotary_sources)
    src_c, src_s, c, s = rotary_sources(d, cos_ptr, sin_ptr, t, HALF)
    rot_d = d < 2 * HALF
    base = qkv_ptr + b * s_qkv_b + t * s_qkv_t + j[:, None] * HD
    raw = tl.load(base + d[None, :], mask=ok, other=0.0)
    is_qk = (j < NH + NKV)[:, None]
    rot = is_qk & rot_d[None, :]
    xc = tl.load(base + src_c[None, :], mask=ok & rot, other=0.0).to(tl.float32)
    xs = tl.load(base + src_s[None, :], mask=ok & rot, other=0.0).to(tl.float32)
    r = xc * c[None, :] + xs * s[None, :]
    # q
    is_q = (j < NH)[:, None]
    q_val = tl.where(rot, r, raw.to(tl.float32)).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + b * s_q_b + t * s_q_t + j[:, None] * HD + d[None, :], q_val,
             mask=ok & is_q)
    # k (rotated, the cache's interleaved order)
    kh = tl.where(is_qk & ~is_q, j[:, None] - NH, 0)
    k_val = tl.where(rot, r, raw.to(tl.float32)).to(k_ptr.dtype.element_ty)
    tl.store(k_ptr + b * s_k_b + kh * s_k_h + t * s_k_t + d[None, :], k_val,
             mask=ok & is_qk & ~is_q)
    # v (as it is)
    vh = tl.where(~is_qk, j[:, None] - NH - NKV, 0)
    tl.store(v_ptr + b * s_v_b + vh * s_v_h + t * s_v_t + d[None, :],
             raw.to(v_ptr.dtype.element_ty), mask=ok & ~is_qk)


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
                  heads_per_program: int = 32) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1): one program per
    (token, block of heads_per_program head slots). Returns q [n, T, nh, hd]."""
    n, t, hd, half = _check(qkv, cos, sin, n_heads, n_kv_heads, k_cache, v_cache)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q = torch.empty(n, t, n_heads, hd, device=qkv.device, dtype=qkv.dtype)
    slots = n_heads + 2 * n_kv_heads
    hb = min(triton.next_power_of_2(slots), heads_per_program)
    if n * t:
        _rope_kv_write_kernel[(n * t, triton.cdiv(slots, hb))](
            qkv, qkv.stride(0), qkv.stride(1), cos, sin,
            q, q.stride(0), q.stride(1),
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), t,
            NH=n_heads, NKV=n_kv_heads, HD=hd, HD_P2=triton.next_power_of_2(hd), HALF=half,
            HB=hb, num_warps=4)
    return q


__all__ = ["rope_kv_write", "rope_kv_write_reference"]
