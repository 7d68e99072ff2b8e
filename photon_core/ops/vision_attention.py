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


def vision_attention(qkv: torch.Tensor, n_heads: int, config: tuple | None = None
                     ) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1). qkv [n, T, 3 H hd]
    with a contiguous last dim -> o [n, T, H hd] contiguous. config: (BLOCK_M, BLOCK_N,
    num_warps, num_stages), default CONFIG."""
    n, t, hd = _check(qkv, n_heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    bm, bn, warps, stages = config or CONFIG
    hd_a, hd_b = _split_head(hd)
    if hd_a < 16:
        raise ValueError(f"head size {hd} < 16: tl.dot needs 16")
    o = torch.empty(n, t, n_heads * hd, device=qkv.device, dtype=qkv.dtype)
    if n * t:
        _vision_attention_kernel[(triton.cdiv(t, bm), n * n_heads)](
            qkv, qkv.stride(0), qkv.stride(1), o, o.stride(0), o.stride(1), t,
            hd ** -0.5 * math.log2(math.e), H=n_heads, HD=hd, HD_A=hd_a, HD_B=hd_b,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return o


__all__ = ["CONFIG", "TIMED_CONFIGS", "vision_attention", "vision_attention_reference"]
