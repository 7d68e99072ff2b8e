"""Interleaved multimodal rotary embedding (M-RoPE, Qwen 3.5) and its application.

Positions come in three rows (temporal, height, width); text tokens have three equal rows,
image tokens (t0, t0 + row, t0 + col). Of the F = rot_dim/2 frequencies, frequency i takes its
angle from row 1 (height) when i % 3 == 1 and i < 3*sections[1], from row 2 (width) when
i % 3 == 2 and i < 3*sections[2], else from row 0. The rotation is rotate-half style over the
first rot_dim dims of each head (partial rotary); the rest pass through.
"""
from __future__ import annotations

import torch


def inv_freq(rot_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))


def mrope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float, sections,
                  dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] (int) -> cos, sin [T, rot_dim] in dtype."""
    freqs = positions.float()[..., None] * inv_freq(rot_dim, theta, positions.device)  # [3, T, F]
    sel = freqs[0].clone()
    for row in (1, 2):
        idx = slice(row, sections[row] * 3, 3)
        sel[..., idx] = freqs[row][..., idx]
    emb = torch.cat([sel, sel], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] (heads before T), cos/sin [T, R] with R <= D: rotate the first R dims."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """Per-head zero-centred RMSNorm then rotary (the q/k path of a full-attention layer):
    x [..., T, D] (heads before T), cos/sin [T, R]."""
    from .rmsnorm_zero_centred import rmsnorm_zero_centred
    return apply_rope(rmsnorm_zero_centred(x, weight, eps), cos, sin)


# -- Triton: q/k norm + rotary of one decode token, fused ---------------------------------------
# grid (Hq + Hkv,): program h < Hq normalises and rotates query head h, the others key head
# h - Hq. Each program loads its head twice (the values and their rotate-half partners), does
# the zero-centred RMSNorm in fp32 (rounded to the input dtype as the reference does), rotates
# the first R dims with the precomputed cos/sin of this token and stores the head; the key
# heads can be stored straight into the k/v cache (any head stride).
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    @triton.jit
    def _norm_rope_head(x_ptr, w_ptr, o_ptr, cos_ptr, sin_ptr, D, R, eps, BD: tl.constexpr,
                        CM: tl.constexpr):
        # (CM: the cache modifier of the x loads; ".cg" in the hybrid megakernel, where x was
        # written by another SM during the launch: L2, never a stale L1 line)
        i = tl.arange(0, BD)
        m = i < D
        x = tl.load(x_ptr + i, mask=m, other=0.0, cache_modifier=CM).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        half = R // 2
        rot = i < R
        first = i < half
        p = tl.where(first, i + half, i - half)
        p = tl.where(rot, p, i)
        xp = tl.load(x_ptr + p, mask=m, other=0.0, cache_modifier=CM).to(tl.float32)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + p, mask=m, other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        y = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + i, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + i, mask=rot, other=0.0).to(tl.float32)
        out = y * c + tl.where(first, -yp, yp) * s
        out = tl.where(rot, out, y)
        tl.store(o_ptr + i, out.to(dt), mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                             HQ, D, R, sq, sk, sqo, sko, eps, BD: tl.constexpr):
        h = tl.program_id(0)
        if h < HQ:
            _norm_rope_head(q_ptr + h * sq, qw_ptr, qo_ptr + h * sqo, cos_ptr, sin_ptr, D, R,
                            eps, BD, "")
        else:
            hk = h - HQ
            _norm_rope_head(k_ptr + hk * sk, kw_ptr, ko_ptr + hk * sko, cos_ptr, sin_ptr, D, R,
                            eps, BD, "")


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float = 1e-6, k_out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q [Hq, D], k [Hkv, D] (any head stride), cos/sin [R] (or [1, R]) ->
    (norm_rope(q), norm_rope(k)), the q result new [Hq, D]; the k result is written into k_out
    when given (e.g. the cache slot state.k[i][:, pos], [Hkv, D] with any head stride)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    hq, d = q.shape
    hkv = k.shape[0]
    cos, sin = cos.reshape(-1), sin.reshape(-1)
    r = cos.shape[0]
    if k.shape[1] != d or r > d or r % 2 or sin.shape != cos.shape:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}"
                         " do not fit")
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(hq, d, dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(hkv, d, dtype=k.dtype, device=k.device)
    elif k_out.shape != (hkv, d) or k_out.stride(-1) != 1:
        raise ValueError(f"k_out must be [{hkv}, {d}] with unit last stride")
    _qk_norm_rope_kernel[(hq + hkv,)](q, k, q_weight.contiguous(), k_weight.contiguous(), q_out,
                                      k_out, cos, sin, hq, d, r, q.stride(0), k.stride(0),
                                      q_out.stride(0), k_out.stride(0), eps,
                                      BD=triton.next_power_of_2(d))
    return q_out, k_out


def rope_table(n: int, rot_dim: int, theta: float, sections, dtype=torch.float32, device=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rot_dim] of text positions 0 .. n-1 (three equal M-RoPE rows), exactly the
    values mrope_cos_sin gives a token at that position: the rows kernel below indexes them."""
    pos = torch.arange(n, device=device)[None].expand(3, n)
    cos, sin = mrope_cos_sin(pos, rot_dim, theta, sections, dtype)
    return cos.contiguous(), sin.contiguous()


# -- Triton: q/k norm + rotary over a decode bucket's rows, k/v into the cache -------------------
# grid (b, Hq + Hkv): program (r, h < Hq) normalises and rotates query head h of row r into
# q_out; program (r, Hq + j) does key head j and stores it, with value head j copied as is,
# into the row's cache slot at position min(pos[r], capacity - 1) (only when active[r]: an
# inactive row's cache is untouched). The rotary position pos[r] + offset[r] (text tokens:
# three equal M-RoPE rows) indexes cos/sin tables [n, R] (rope_table; clamped to 0 .. n-1);
# positions and offsets are read on the device (CUDA-graph friendly).
if triton is not None:
    from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

    @triton.jit
    def _qk_norm_rope_rows_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, qo_ptr, kc_ptr, vc_ptr,
                                  cos_ptr, sin_ptr, pos_ptr, off_ptr, act_ptr, HQ, D, R, NTAB,
                                  CAP, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sqo_b, sqo_h,
                                  skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, eps,
                                  HAS_ACTIVE: tl.constexpr, BD: tl.constexpr,
                                  GDC: tl.constexpr = False):
        pdl_launch_dependents(GDC)
        pdl_wait(GDC)
        r = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + r)
        rp = tl.minimum(tl.maximum(pos + tl.load(off_ptr + r), 0), NTAB - 1)
        cos_row = cos_ptr + rp * R
        sin_row = sin_ptr + rp * R
        if h < HQ:
            _norm_rope_head(q_ptr + r * sq_b + h * sq_h, qw_ptr, qo_ptr + r * sqo_b + h * sqo_h,
                            cos_row, sin_row, D, R, eps, BD, "")
        else:
            j = h - HQ
            go = 1
            if HAS_ACTIVE:
                go = tl.load(act_ptr + r)
            if go != 0:
                slot = tl.minimum(pos, CAP - 1)
                _norm_rope_head(k_ptr + r * sk_b + j * sk_h, kw_ptr,
                                kc_ptr + r * skc_b + j * skc_h + slot * skc_s, cos_row, sin_row,
                                D, R, eps, BD, "")
                i = tl.arange(0, BD)
                m = i < D
                v = tl.load(v_ptr + r * sv_b + j * sv_h + i, mask=m, other=0.0)
                tl.store(vc_ptr + r * svc_b + j * svc_h + slot * svc_s + i,
                         v.to(vc_ptr.dtype.element_ty), mask=m)


def qk_norm_rope_rows_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q_weight: torch.Tensor, k_weight: torch.Tensor, kc: torch.Tensor,
                             vc: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6,
                             active: torch.Tensor | None = None,
                             q_out: torch.Tensor | None = None, pdl: bool = False
                             ) -> torch.Tensor:
    """A decode step over rows 0 .. b-1 (the q/k part of gated_attention.gated_attention_rows):
    q [b, Hq, D], k, v [b, Hkv, D] (any row / head strides, unit last stride; e.g. views of
    the projections' buffer), kc, vc [>= b, Hkv, capacity, D] (one layer of the state cache,
    row r in slot r), pos, offset [b] int (cache position; rotary position pos + offset),
    cos, sin [n, R] tables (rope_table), active [b] bool or None (all rows write their k/v).
    -> q_out [b, Hq, D] (normed, rotated; new when None). pdl: ops/pdl.py."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, hq, d = q.shape
    hkv = k.shape[1]
    n, r = cos.shape
    cap = kc.shape[2]
    if k.shape != (b, hkv, d) or v.shape != k.shape or kc.shape[0] < b or \
            kc.shape[1:] != (hkv, cap, d) or vc.shape != kc.shape or r > d or r % 2 or \
            sin.shape != cos.shape or pos.shape != (b,) or offset.shape != (b,):
        raise ValueError(f"qk_norm_rope_rows_triton: shapes q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, kc {tuple(kc.shape)}, cos "
                         f"{tuple(cos.shape)}, pos {tuple(pos.shape)} do not fit")
    if active is not None and (active.shape != (b,) or active.dtype != torch.bool):
        raise ValueError(f"active must be a [{b}] bool tensor")
    if any(t.stride(-1) != 1 for t in (q, k, v, kc, vc)):
        raise ValueError("q, k, v, kc, vc need a unit last stride")
    cos, sin = cos.contiguous(), sin.contiguous()
    if q_out is None:
        q_out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    elif q_out.shape != (b, hq, d) or q_out.stride(-1) != 1:
        raise ValueError(f"q_out must be [{b}, {hq}, {d}] with unit last stride")
    act = active.view(torch.uint8) if active is not None else pos
    _, gdc, launch_kw = pdl_launch(pdl, q)
    _qk_norm_rope_rows_kernel[(b, hq + hkv)](
        q, k, v, q_weight.contiguous(), k_weight.contiguous(), q_out, kc, vc, cos, sin, pos,
        offset, act, hq, d, r, n, cap, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), eps,
        HAS_ACTIVE=active is not None, BD=triton.next_power_of_2(d), GDC=gdc, **launch_kw)
    return q_out
