"""Bidirectional attention of the vision tower (SigLIP: no mask, head size 72 in Moondream 2)
straight from the fused qkv GEMM output, torch reference and Triton flash-attention kernel
side by side.

    o = vision_attention(qkv, n_heads)       # qkv [n, T, 3 * H * hd] -> o [n, T, H * hd]

qkv's columns are [q | k | v], each H heads of hd (vision.encoder's chunk(3) + view); o is
token-major, the layout the output projection reads (no transpose copy).

Why a kernel: cuDNN's SDPA runs hd = 72 in 128-wide tiles (its kernel name on the H200:
..._64x128x128_...): 44 % of its tensor-core work is padding. Here the head is split into a
64-wide part and a 16-wide part (channels 64..71 and 8 zero channels): QK^T = Q[:, :64]
K[:, :64]^T + Q[:, 64:80] K[:, 64:80]^T and PV in two dots of 64 and 16 columns, so 80 of
128 columns are computed (11 % padding). Flash form: one program per (block of BLOCK_M
queries, crop x head), an online softmax over blocks of BLOCK_N keys (exp2, fp32 statistics),
P rounded to the input dtype for the PV dot, as the flash kernels do. Any head size works:
HD_A = the largest power of two <= hd, HD_B = the rest rounded up to a power of two >= 16
(0 when hd is a power of two).

Reference: F.scaled_dot_product_attention over the q, k, v views (what vision.encoder runs).
Close, not bitwise (other tiling of the sums).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._triton import tl, triton

try:                                                   # Triton >= 3.4: host-side descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - depends on the Triton version
    TensorDescriptor = None

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the default; bench/probe_encode.py times others
CONFIG = (128, 64, 8, 3)
# prefix_attention's default (BLOCK_M, BLOCK_N, warps, stages)
PREFIX_CONFIG = (64, 64, 4, 3)
# the configs bench/probe_encode.py times on the GPU and bench/compile_sm90.py compiles
TIMED_CONFIGS = ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3),
                 (128, 32, 4, 4))


@triton.jit
def _vision_attention_kernel(qkv_ptr, s_b, s_t, o_ptr, so_b, so_t, T, scale_log2e,
                             H: tl.constexpr, HD: tl.constexpr, HD_A: tl.constexpr,
                             HD_B: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    qbase = qkv_ptr + b * s_b + h * HD
    kbase = qbase + H * HD
    vbase = qbase + 2 * H * HD
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < T
    da = tl.arange(0, HD_A)
    q_a = tl.load(qbase + rm[:, None] * s_t + da[None, :], mask=m_ok[:, None], other=0.0)
    acc_a = tl.zeros([BLOCK_M, HD_A], dtype=tl.float32)
    if HD_B > 0:
        db = HD_A + tl.arange(0, HD_B)
        b_ok = db < HD
        q_b = tl.load(qbase + rm[:, None] * s_t + db[None, :],
                      mask=m_ok[:, None] & b_ok[None, :], other=0.0)
        acc_b = tl.zeros([BLOCK_M, HD_B], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, T, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        n_ok = rn < T
        k_a = tl.load(kbase + rn[None, :] * s_t + da[:, None], mask=n_ok[None, :], other=0.0)
        s = tl.dot(q_a, k_a)
        if HD_B > 0:
            k_b = tl.load(kbase + rn[None, :] * s_t + db[:, None],
                          mask=n_ok[None, :] & b_ok[:, None], other=0.0)
            s = tl.dot(q_b, k_b, s)
        s = tl.where(n_ok[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        p = p.to(q_a.dtype)
        v_a = tl.load(vbase + rn[:, None] * s_t + da[None, :], mask=n_ok[:, None], other=0.0)
        acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
        if HD_B > 0:
            v_b = tl.load(vbase + rn[:, None] * s_t + db[None, :],
                          mask=n_ok[:, None] & b_ok[None, :], other=0.0)
            acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    inv = 1.0 / l_i
    obase = o_ptr + b * so_b + h * HD
    tl.store(obase + rm[:, None] * so_t + da[None, :],
             (acc_a * inv[:, None]).to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    if HD_B > 0:
        tl.store(obase + rm[:, None] * so_t + db[None, :],
                 (acc_b * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & b_ok[None, :])


@triton.jit
def _exp2(x, FAST_EXP: tl.constexpr):
    """2^x (x <= 0) as the PV dot's 16-bit p: fp32 ex2 then rounded; or FAST_EXP (CUDA
    bf16 only): x rounded to bf16 pairs (cvt.rn.bf16x2) and ex2.approx.ftz.bf16x2 (sm_90
    has no packed ex2 unit: ptxas makes it one bf16 MUFU.EX2 per element), the bf16 result
    straight away."""
    if FAST_EXP:
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 t;\n\tcvt.rn.bf16x2.f32 t, $2, $1;\n\t"
            "ex2.approx.ftz.bf16x2 $0, t;\n\t}",
            "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.exp2(x)


@triton.jit
def _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, k_da, k_db, v_da, v_db, row, k_col, v_col,
               kv_left, scale_log2e, HD_B: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr, FAST_EXP: tl.constexpr):
    """One block of BLOCK_N keys (rows row.. of the 2-D k / v spaces) into the online
    softmax. MASK (the last, partial block): keys from kv_left on are another crop's or
    head's (or TMA's zero fill past the tensor): their scores -inf, their values zeroed (no
    0 x inf)."""
    k_a = k_da.load([row, k_col])
    s = tl.dot(q_a, tl.trans(k_a))
    if HD_B > 0:
        k_b = k_db.load([row, k_col + q_a.shape[1]])
        s = tl.dot(q_b, tl.trans(k_b), s)
    if MASK:
        n_ok = tl.arange(0, BLOCK_N) < kv_left
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    alpha = tl.exp2(m_i - m_new)
    p = _exp2(s * scale_log2e - m_new[:, None], FAST_EXP)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)        # (fp32 p: no conversion)
    p = p.to(q_a.dtype)
    v_a = v_da.load([row, v_col])
    if MASK:
        v_a = tl.where(n_ok[:, None], v_a, 0.0)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
    if HD_B > 0:
        v_b = v_db.load([row, v_col + q_a.shape[1]])
        if MASK:
            v_b = tl.where(n_ok[:, None], v_b, 0.0)
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _attention_tma_kernel(q_da, q_db, k_da, k_db, v_da, v_db, o_ptr, so_b, so_t, T,
                          scale_log2e, KV_RB, KV_RH, K_C0, V_C0,
                          H: tl.constexpr, G: tl.constexpr, KV_CH: tl.constexpr,
                          HD: tl.constexpr, HD_A: tl.constexpr, HD_B: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          FAST_EXP: tl.constexpr):
    """The TMA form: one program per (BLOCK_M queries, batch x head); q / k / v tiles as
    bulk copies through host descriptors ([BLOCK_M | BLOCK_N] x [HD_A | HD_B] boxes). q of
    (b, h) at 2-D (b T + m, h HD); k / v of kv head h // G at (b KV_RB + (h // G) KV_RH +
    j, K_C0 | V_C0 + (h // G) KV_CH). The full key blocks unmasked, the last partial one
    masked. The HD_B boxes read past the head's hd columns (finite neighbours): q's are
    zeroed, so k's multiply zeros, and v's land in output columns that are not stored.
    Query rows past T are computed and not stored."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    q_col = h * HD
    m0 = pid_m * BLOCK_M
    q_a = q_da.load([b * T + m0, q_col])
    acc_a = tl.zeros([BLOCK_M, HD_A], dtype=tl.float32)
    if HD_B > 0:
        db = tl.arange(0, HD_B)
        q_b = q_db.load([b * T + m0, q_col + HD_A])
        q_b = tl.where((HD_A + db < HD)[None, :], q_b, 0.0)
        acc_b = tl.zeros([BLOCK_M, HD_B], dtype=tl.float32)
    else:
        q_b = q_a
        acc_b = acc_a
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    row0 = b * KV_RB + hk * KV_RH
    k_col = K_C0 + hk * KV_CH
    v_col = V_C0 + hk * KV_CH
    n_full = T // BLOCK_N
    for j in range(0, n_full):
        acc_a, acc_b, m_i, l_i = _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, k_da, k_db,
                                            v_da, v_db, row0 + j * BLOCK_N, k_col, v_col,
                                            BLOCK_N, scale_log2e, HD_B, BLOCK_N, False,
                                            FAST_EXP)
    if n_full * BLOCK_N < T:
        acc_a, acc_b, m_i, l_i = _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, k_da, k_db,
                                            v_da, v_db, row0 + n_full * BLOCK_N, k_col,
                                            v_col, T - n_full * BLOCK_N, scale_log2e, HD_B,
                                            BLOCK_N, True, FAST_EXP)
    inv = 1.0 / l_i
    rm = m0 + tl.arange(0, BLOCK_M)
    m_ok = rm < T
    obase = o_ptr + b.to(tl.int64) * so_b + q_col
    da = tl.arange(0, HD_A)
    tl.store(obase + rm[:, None] * so_t + da[None, :],
             (acc_a * inv[:, None]).to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    if HD_B > 0:
        tl.store(obase + rm[:, None] * so_t + HD_A + db[None, :],
                 (acc_b * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (HD_A + db < HD)[None, :])

def _split_head(hd: int) -> tuple[int, int]:
    hd_a = 1 << (hd.bit_length() - 1)
    rest = hd - hd_a
    return hd_a, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def _check(qkv: torch.Tensor, n_heads: int) -> tuple[int, int, int]:
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * n_heads):
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [n, T, 3 * {n_heads} * head_dim]")
    n, t, width = qkv.shape
    return n, t, width // (3 * n_heads)


def vision_attention_reference(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """SDPA over the views (vision.encoder's math): -> [n, T, H * hd]."""
    n, t, hd = _check(qkv, n_heads)
    q, k, v = qkv.view(n, t, 3, n_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, n_heads * hd)


def _tma_ok(qkv: torch.Tensor) -> bool:
    """Host descriptors need 16-byte aligned base and row stride (a GEMM's output is)."""
    es = qkv.element_size()
    return (TensorDescriptor is not None and qkv.is_contiguous()
            and qkv.data_ptr() % 16 == 0 and (qkv.shape[-1] * es) % 16 == 0)


def _descriptors(x2: torch.Tensor, rows: int, hd_a: int, hd_b: int) -> tuple:
    """The [rows, hd_a] and [rows, hd_b] box descriptors of a 2-D tensor (the second the
    first again where hd_b is 0: not loaded)."""
    a = TensorDescriptor.from_tensor(x2, [rows, hd_a])
    return a, (TensorDescriptor.from_tensor(x2, [rows, hd_b]) if hd_b else a)


def vision_attention(qkv: torch.Tensor, n_heads: int, config: tuple | None = None
                     ) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1). qkv [n, T, 3 H hd]
    with a contiguous last dim -> o [n, T, H hd] contiguous. config: (BLOCK_M, BLOCK_N,
    num_warps, num_stages[, tma[, fast_exp]]), default CONFIG; tma 1: the descriptor form
    (where the layout allows it, else the pointer form); fast_exp 1: its bf16x2 ex2 (CUDA,
    bf16 only; ignored elsewhere)."""
    n, t, hd = _check(qkv, n_heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    bm, bn, warps, stages, *rest = config or CONFIG
    tma = bool(rest[0]) if rest else False
    fast_exp = bool(rest[1]) if len(rest) > 1 else False
    hd_a, hd_b = _split_head(hd)
    if hd_a < 16:
        raise ValueError(f"head size {hd} < 16: tl.dot needs 16")
    o = torch.empty(n, t, n_heads * hd, device=qkv.device, dtype=qkv.dtype)
    if not n * t:
        return o
    grid = (triton.cdiv(t, bm), n * n_heads)
    scale = hd ** -0.5 * math.log2(math.e)
    if tma and _tma_ok(qkv):
        q2 = qkv.view(n * t, qkv.shape[-1])
        d_m, d_n = _descriptors(q2, bm, hd_a, hd_b), _descriptors(q2, bn, hd_a, hd_b)
        _attention_tma_kernel[grid](
            *d_m, *d_n, *d_n, o, o.stride(0), o.stride(1), t, scale, t, 0,
            n_heads * hd, 2 * n_heads * hd, H=n_heads, G=1, KV_CH=hd, HD=hd, HD_A=hd_a,
            HD_B=hd_b, BLOCK_M=bm, BLOCK_N=bn,
            FAST_EXP=fast_exp and qkv.is_cuda and qkv.dtype == torch.bfloat16,
            num_warps=warps, num_stages=stages)
        return o
    _vision_attention_kernel[grid](
        qkv, qkv.stride(0), qkv.stride(1), o, o.stride(0), o.stride(1), t,
        scale, H=n_heads, HD=hd, HD_A=hd_a, HD_B=hd_b,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return o


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     config: tuple | None = None) -> torch.Tensor:
    """Unmasked attention of token-major q [n, T, H, hd] over head-major k / v [n, Hkv, T,
    hd] (the image-prefix prefill's rope_kv_write output and cache rows) -> o [n, T, H hd],
    token-major; the TMA kernel (config: (BLOCK_M, BLOCK_N, num_warps, num_stages[, _[,
    fast_exp]])). Reference: SDPA over q.transpose(1, 2), k, v (enable_gqa)."""
    n, t, nh, hd = q.shape
    nkv = k.shape[1]
    if (tuple(k.shape) != (n, nkv, t, hd) or k.shape != v.shape or nh % nkv
            or not all(x.is_contiguous() for x in (q, k, v))):
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} "
                         "are not contiguous [n, T, H, hd] / [n, Hkv, T, hd]")
    if not all(_tma_ok(x) for x in (q, k, v)):
        raise ValueError("prefix_attention needs 16-byte aligned rows (TMA descriptors)")
    bm, bn, warps, stages, *rest = config or PREFIX_CONFIG
    fast_exp = bool(rest[1]) if len(rest) > 1 else False
    hd_a, hd_b = _split_head(hd)
    o = torch.empty(n, t, nh * hd, device=q.device, dtype=q.dtype)
    if not n * t:
        return o
    dq = _descriptors(q.view(n * t, nh * hd), bm, hd_a, hd_b)
    dk = _descriptors(k.view(n * nkv * t, hd), bn, hd_a, hd_b)
    dv = _descriptors(v.view(n * nkv * t, hd), bn, hd_a, hd_b)
    _attention_tma_kernel[(triton.cdiv(t, bm), n * nh)](
        *dq, *dk, *dv, o, o.stride(0), o.stride(1), t, hd ** -0.5 * math.log2(math.e),
        nkv * t, t, 0, 0, H=nh, G=nh // nkv, KV_CH=0, HD=hd, HD_A=hd_a, HD_B=hd_b,
        BLOCK_M=bm, BLOCK_N=bn, FAST_EXP=fast_exp and q.is_cuda and q.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages)
    return o


__all__ = ["CONFIG", "PREFIX_CONFIG", "TIMED_CONFIGS", "prefix_attention", "vision_attention",
           "vision_attention_reference"]
