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
    """2^x (x <= 0): fp32 ex2 per element, the result rounded to bf16 for the PV dot; or
    FAST_EXP (CUDA bf16 only): pairs packed to bf16x2 (round to nearest), one ex2.approx
    .ftz.bf16x2 per pair - half the MUFU operations, the bf16 result straight away."""
    if FAST_EXP:
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 t;\n\tcvt.rn.bf16x2.f32 t, $2, $1;\n\t"
            "ex2.approx.ftz.bf16x2 $0, t;\n\t}",
            "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.exp2(x)


@triton.jit
def _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, kv_a, kv_b, row, k_col, v_col, kv_left,
               scale_log2e, HD_B: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               FAST_EXP: tl.constexpr):
    """One block of BLOCK_N keys (rows row.. of the 2-D qkv) into the online softmax. MASK
    (the last, partial block): keys from kv_left on belong to the next crop (or are TMA's
    zero fill past the tensor): their scores -inf, their values zeroed (no 0 x inf)."""
    k_a = kv_a.load([row, k_col])
    s = tl.dot(q_a, tl.trans(k_a))
    if HD_B > 0:
        k_b = kv_b.load([row, k_col + q_a.shape[1]])
        s = tl.dot(q_b, tl.trans(k_b), s)
    if MASK:
        n_ok = tl.arange(0, BLOCK_N) < kv_left
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    alpha = tl.exp2(m_i - m_new)
    p = _exp2(s * scale_log2e - m_new[:, None], FAST_EXP).to(q_a.dtype)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
    v_a = kv_a.load([row, v_col])
    if MASK:
        v_a = tl.where(n_ok[:, None], v_a, 0.0)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
    if HD_B > 0:
        v_b = kv_b.load([row, v_col + q_a.shape[1]])
        if MASK:
            v_b = tl.where(n_ok[:, None], v_b, 0.0)
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _vision_attention_tma_kernel(q_da, q_db, kv_a, kv_b, o_ptr, so_b, so_t, T, scale_log2e,
                                 H: tl.constexpr, HD: tl.constexpr, HD_A: tl.constexpr,
                                 HD_B: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, FAST_EXP: tl.constexpr):
    """The TMA form: q / k / v tiles as bulk copies of the 2-D qkv [n T, 3 H hd] through
    host descriptors ([BLOCK_M | BLOCK_N] x [HD_A | HD_B] boxes at the head's columns), the
    full key blocks unmasked, the last partial one masked. The HD_B box reads past the
    head's hd columns (the next head's, finite): q's are zeroed, so k's multiply zeros, and
    v's land in output columns that are not stored. Query rows past T (the next crop's)
    are computed and not stored."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row0 = b * T
    q_col = h * HD
    m0 = pid_m * BLOCK_M
    q_a = q_da.load([row0 + m0, q_col])
    acc_a = tl.zeros([BLOCK_M, HD_A], dtype=tl.float32)
    if HD_B > 0:
        db = tl.arange(0, HD_B)
        q_b = q_db.load([row0 + m0, q_col + HD_A])
        q_b = tl.where((HD_A + db < HD)[None, :], q_b, 0.0)
        acc_b = tl.zeros([BLOCK_M, HD_B], dtype=tl.float32)
    else:
        q_b = q_a
        acc_b = acc_a
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_col = H * HD + q_col
    v_col = 2 * H * HD + q_col
    n_full = T // BLOCK_N
    for j in range(0, n_full):
        acc_a, acc_b, m_i, l_i = _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, kv_a, kv_b,
                                            row0 + j * BLOCK_N, k_col, v_col, BLOCK_N,
                                            scale_log2e, HD_B, BLOCK_N, False, FAST_EXP)
    if n_full * BLOCK_N < T:
        acc_a, acc_b, m_i, l_i = _key_block(q_a, q_b, acc_a, acc_b, m_i, l_i, kv_a, kv_b,
                                            row0 + n_full * BLOCK_N, k_col, v_col,
                                            T - n_full * BLOCK_N, scale_log2e, HD_B, BLOCK_N,
                                            True, FAST_EXP)
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
        descs = [TensorDescriptor.from_tensor(q2, [rows, cols])
                 for rows in (bm, bn) for cols in (hd_a, hd_b or hd_a)]
        fast_exp = fast_exp and qkv.is_cuda and qkv.dtype == torch.bfloat16
        _vision_attention_tma_kernel[grid](
            descs[0], descs[1], descs[2], descs[3], o, o.stride(0), o.stride(1), t, scale,
            H=n_heads, HD=hd, HD_A=hd_a, HD_B=hd_b, BLOCK_M=bm, BLOCK_N=bn,
            FAST_EXP=fast_exp, num_warps=warps, num_stages=stages)
        return o
    _vision_attention_kernel[grid](
        qkv, qkv.stride(0), qkv.stride(1), o, o.stride(0), o.stride(1), t,
        scale, H=n_heads, HD=hd, HD_A=hd_a, HD_B=hd_b,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return o


__all__ = ["CONFIG", "TIMED_CONFIGS", "vision_attention", "vision_attention_reference"]
