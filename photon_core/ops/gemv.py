"""Weight GEMV / skinny GEMM for decode: y[b, n] = sum_k x[b, k] * W[n, k] (+ bias), b <= 16.

Weights are [N, K] row-major (the torch Linear layout). fp32 weights: tl.dot in exact fp32
(input_precision="ieee"; Triton's default on the GPU is TF32, whose 10-bit mantissas moved
the fp32 tiny Gemma 4 model's logits by 0.022 on the H200 where the reference and the
interpreter agree to 3e-5; emulating TF32 truncation of the GEMV inputs on the CPU gives the
same 0.022). bf16 / fp16 weights are unaffected. Each program owns BLOCK_N output
rows and streams its K range (K / SPLIT_K) in [BLOCK_N, BLOCK_K] tiles; the activations are
tiny and stay in L2. Two inner-product forms: `dot` (tl.dot on [16, BLOCK_K] x [BLOCK_K,
BLOCK_N], tensor cores, any b <= 16) and `fma` (b == 1: elementwise multiply into a
[BLOCK_N, BLOCK_K] fp32 accumulator, one reduction at the end). One program per (row
tile, K split). (Grids that give every SM an equal share - persistent programs looping over
the tiles, or the rows shared out evenly - measured no faster on the H200: session 41,
docs/dropped_experiments.md.)

Epilogues (EPI):
  EPI_STORE    y = (acc + bias) in y's dtype
  EPI_QKV_GELU the fused [qkv | fc1] projection of a parallel block: columns n < n_split
               store acc + bias; columns n >= n_split store gelu_tanh(acc + bias) (the sum
               rounded to y's dtype first, like a Linear followed by GELU) at column n + gap
  EPI_RESIDUAL y (fp32 residual stream) += acc + bias (bias from split 0 only); SPLIT_K > 1
               adds with fp32 atomics, so the sum order varies between runs.
  EPI_GATED    a gated MLP's [gate, up] projection and its activation in one pass: W's rows
               come in (gate, up) pairs (rows 2j, 2j + 1; `interleave_gated`), each sum
               rounded to y's dtype, then y[:, j] = act(gate) * up in fp32, rounded once -
               the gated activation kernel's math (ops/gated_activation.py), so the
               result is that of the GEMV into [gate | up] followed by that kernel
  EPI_ACT_MUL  y = act(acc + bias rounded to y's dtype) * mul[:, n] (Gemma 4's per-layer
               input gate: gelu_tanh(x W^T) * ple), the same math
  act (ACT): ACT_GELU_TANH or ACT_SILU.
x may be the fp32 residual stream: it is rounded to the weights' dtype as it is loaded, the
same values as torch's x.to(w.dtype) before the call.

Torch references (the eager backend's ops, and what the kernel is diff-tested against):
`linear`, `linear_gelu`, and `gemv_reference` (the kernel's contract, epilogues included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import tl, triton

from . import GEMV_MAX_ROWS
from .gated_activation import (ACT_GELU_TANH, ACT_SILU, ACTIVATIONS, gated_activation,
                               gated_value)
from . import pdl as _pdl
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

try:                                                   # Triton >= 3.4: host-side descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - depends on the Triton version
    TensorDescriptor = None

EPI_STORE, EPI_QKV_GELU, EPI_RESIDUAL, EPI_GATED, EPI_ACT_MUL = 0, 1, 2, 3, 4
# the weight tiles by bulk tensor copies (tma_weights): "auto" | "on" | "off". H200, Moondream
# 2's decode GEMVs, same tiles, against the pointer loads (bench/probe_tma_gemv.py,
# docs/benchmarks.md session 35 calls 3-4), us: the split-K residual GEMV 2048 x 10240 at b =
# 2 / 4 / 8 13.76 / 13.89 / 13.92 vs 14.57 / 14.66 / 14.83 (with relaxed atomics 13.25 /
# 13.33 / 13.37); [qkv | fc1] 14336 x 2048 17.59-17.85 vs 17.33-17.74 and the lm head at b=1
# 55.73 vs 54.28 (slower: "auto" leaves them on the pointer loads). Whole fused steps at
# position 760 (bench/ab_switch.py, call 5), b = 1 / 2 / 4 / 8: 0.9549 / 1.0537 / 1.1813 /
# 1.3862 ms vs 0.9543 / 1.0711 / 1.1967 / 1.3996 with "off". Qwen 3.5 0.8B's residual GEMVs
# (16 x 128 split-K tiles) by TMA: steps at b = 2 / 4 / 8 0.98x / 0.99x / 0.99x, Gemma 4 E2B
# 0.99-1.00x (call 6): "auto" takes tiles of 16 KB and more only
TMA = "auto"
# split-K partial sums added with relaxed atomics (no ordering is needed: the next kernel
# reads the sums after this one ends); False: acq_rel, Triton's default. The residual GEMV
# at b = 1 / 2 / 8 (pointer loads): 12.60 / 13.97 / 14.20 us vs 13.03 / 14.57 / 14.83; whole
# fused steps at 760, b = 1 / 2 / 4 / 8: 0.9573 / 1.0581 / 1.1859 / 1.3896 ms vs 0.9662 /
# 1.0694 / 1.1987 / 1.3995 with acq_rel (call 5); Qwen 3.5 0.8B b=8 1.0167 vs 1.0428 ms,
# b = 1 / 2 / 4 and Gemma 4 E2B within 0.5 % (call 6)
RELAXED_ATOMICS = True


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    def fits(self, b: int, n: int, k: int, epi: int) -> bool:
        if k % (self.block_k * self.split_k):
            return False
        if self.split_k > 1 and epi != EPI_RESIDUAL:
            return False
        if not self.dot and b != 1:
            return False
        if self.dot and (self.block_n < 16 or self.block_k < 16):
            return False
        if epi == EPI_GATED and (self.block_n % 2 or n % 2):
            return False
        return True


@triton.jit
def _weight_tile(w_ptr, w_rows, n0, k0, offs_k, n_ok, TMA: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at (n0, k0): one bulk copy through the descriptor
    w_ptr (TMA; rows past N arrive as zeros), or pointer loads from w_rows (masked rows 0)."""
    if TMA:
        return w_ptr.load([n0, k0])
    else:
        return tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)


@triton.jit
def _products(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc plus one K tile's products of x [BLOCK_B, BLOCK_K] and the weight tile w
    [BLOCK_N, BLOCK_K]: DOT, a tensor-core dot into [BLOCK_B, BLOCK_N] (IEEE: exact fp32);
    else the FMA form's elementwise products of x's one row into [BLOCK_N, BLOCK_K], summed
    over K after the last tile."""
    if DOT:
        if IEEE:
            acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
    else:
        acc += w.to(tl.float32) * x.to(w.dtype).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["B"])     # one binary for every batch size
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, B, N, K, stride_xb, stride_yb, n_split, gap,
                 mul_ptr, stride_mb,
                 EPI: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, PDL: tl.constexpr = False, GDC: tl.constexpr = False,
                 IEEE: tl.constexpr = False, ACT: tl.constexpr = 0, LATE: tl.constexpr = False,
                 TMA: tl.constexpr = False, RELAXED: tl.constexpr = False):
    """Rows pid_n * BLOCK_N.. over K split pid_k, and the epilogue.
    TMA: w_ptr is a TensorDescriptor of W with [BLOCK_N, BLOCK_K] blocks (the weight tiles
    come by bulk tensor copies, rows past N as zeros); else a pointer."""
    if not LATE:
        pdl_launch_dependents(GDC)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < B
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    w_rows = w_ptr                        # (unused with TMA: w_ptr is a descriptor)
    if not TMA:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    x_rows = x_ptr + offs_b[:, None] * stride_xb
    if DOT:
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_first = k_start
    if PDL:     # the first weight tile is loaded before waiting for the previous kernel
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, w_rows, n0, k_start, offs_k, n_ok, TMA)
        pdl_wait(GDC)
        x = tl.load(x_rows + offs_k[None, :], mask=b_ok[:, None], other=0.0)
        acc = _products(acc, x, w, DOT, IEEE)
        k_first = k_start + BLOCK_K
    for kk in range(k_first, k_start + k_len, BLOCK_K):
        offs_k = kk + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, w_rows, n0, kk, offs_k, n_ok, TMA)
        x = tl.load(x_rows + offs_k[None, :], mask=b_ok[:, None], other=0.0)
        acc = _products(acc, x, w, DOT, IEEE)
    if LATE:        # (pdl.LATE_TRIGGER) the next kernel launches during the epilogue
        pdl_launch_dependents(GDC)
    if not DOT:
        acc = tl.sum(acc, axis=1)[None, :]
    mask = b_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if EPI == 2:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    if EPI == 2:
        ptrs = y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)
        else:
            if RELAXED:
                tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
            else:
                tl.atomic_add(ptrs, acc, mask=mask)
    elif EPI == 3:         # (gate, up) row pairs -> act(gate) * up at column n // 2
        t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        g, u = tl.split(tl.reshape(t, [BLOCK_B, BLOCK_N // 2, 2]))
        col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ok = b_ok[:, None] & (col < N // 2)[None, :]
        tl.store(y_ptr + offs_b[:, None] * stride_yb + col[None, :],
                 gated_value(g, u, ACT == 0).to(y_ptr.dtype.element_ty), mask=ok)
    elif EPI == 4:         # act(y) * mul
        t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        m = tl.load(mul_ptr + offs_b[:, None] * stride_mb + offs_n[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_b[:, None] * stride_yb + offs_n[None, :],
                 gated_value(t, m, ACT == 0).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        col = offs_n[None, :]
        val = acc
        if EPI == 1:
            t = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            u = 0.7978845608028654 * (t + 0.044715 * t * t * t)
            g = t / (1.0 + tl.exp(-2.0 * u))          # 0.5 t (1 + tanh u) = t sigmoid(2u)
            hi = col >= n_split
            val = tl.where(hi, g, t)
            col = col + tl.where(hi, gap, 0)
        tl.store(y_ptr + offs_b[:, None] * stride_yb + col, val.to(y_ptr.dtype.element_ty),
                 mask=mask)


# hard picks by measurement on the H200 (bench/bench_kernels.py sweep, 2026-11-29), keyed by
# (n, k, epi, batch == 1); us per call at b=1 / b=8 vs the cuBLAS ops of the previous step:
#   [qkv|fc1]+gelu 14336x2048: 17.7 / 18.1 (78 % of copy bandwidth) vs 23.8 / 24.0
#   [proj|fc2]+res 2048x10240: 13.1 / 14.9 (76 / 66 %) vs 23.5 / 23.8
#   lm_head 51200x2048:        54.7 / 55.5 (91 / 89 %) vs 57.4 / 57.9
DEFAULT = GemvConfig()
TABLE: dict[tuple[int, int, int, bool], GemvConfig] = {
    (14336, 2048, EPI_QKV_GELU, True): GemvConfig(64, 128, 1, 4, 3, True),
    (14336, 2048, EPI_QKV_GELU, False): GemvConfig(64, 128, 1, 4, 3, True),
    (2048, 10240, EPI_RESIDUAL, True): GemvConfig(8, 512, 4, 4, 3, False),
    (2048, 10240, EPI_RESIDUAL, False): GemvConfig(32, 256, 4, 4, 3, True),
    (51200, 2048, EPI_STORE, True): GemvConfig(32, 256, 1, 4, 3, True),
    (51200, 2048, EPI_STORE, False): GemvConfig(32, 256, 1, 4, 3, True),
    # region heads (detect/point), bench/sweep_gemv.py on the H200 (2026-11-29), us at b=1 / 8:
    #   fc1 + gelu 8192x2048: 11.5 / 11.3 (69 %);  coord fc2 1024x8192: 12.6 / 16.5 (31 / 24 %)
    #   size fc2 2048x8192: 13.9 / 17.2 (57 / 46 %)  (N too small for one pass without split-K)
    # b=1 fc2s since session 30 (call 4, the same sweep with two-row fma tiles: 512 / 1024
    # programs instead of 64 / 512): coord 6.81 us vs 12.73, size 10.84 vs 13.61
    (8192, 2048, EPI_QKV_GELU, True): GemvConfig(32, 256, 1, 4, 3, True),
    (8192, 2048, EPI_QKV_GELU, False): GemvConfig(32, 256, 1, 4, 3, True),
    (1024, 8192, EPI_STORE, True): GemvConfig(2, 2048, 1, 8, 3, False),
    (1024, 8192, EPI_STORE, False): GemvConfig(16, 512, 1, 4, 3, True),
    (2048, 8192, EPI_STORE, True): GemvConfig(2, 1024, 1, 4, 3, False),
    (2048, 8192, EPI_STORE, False): GemvConfig(16, 512, 1, 4, 3, True),
}
CANDIDATES = [
    # split_k 1 (every shape)
    GemvConfig(64, 128, 1, 4, 3, True), GemvConfig(32, 256, 1, 4, 3, True),
    GemvConfig(128, 128, 1, 8, 3, True), GemvConfig(64, 256, 1, 8, 3, True),
    GemvConfig(16, 256, 1, 4, 4, True), GemvConfig(32, 128, 1, 4, 4, True),
    GemvConfig(16, 512, 1, 4, 3, False), GemvConfig(32, 256, 1, 4, 3, False),
    GemvConfig(8, 512, 1, 4, 3, False), GemvConfig(64, 128, 1, 4, 4, True),
    GemvConfig(64, 64, 1, 4, 5, True), GemvConfig(32, 512, 1, 4, 3, False),
    # split-K (the residual GEMV, N = 2048)
    GemvConfig(32, 128, 2, 4, 3, True), GemvConfig(32, 256, 4, 4, 3, True),
    GemvConfig(16, 256, 2, 4, 3, True), GemvConfig(64, 128, 4, 4, 4, True),
    GemvConfig(16, 256, 8, 4, 3, True),
    GemvConfig(8, 512, 4, 4, 3, False), GemvConfig(16, 256, 4, 4, 3, False),
    GemvConfig(8, 512, 2, 4, 3, False), GemvConfig(8, 256, 8, 4, 3, False),
    GemvConfig(4, 512, 8, 2, 3, False), GemvConfig(16, 512, 4, 4, 3, False),
    GemvConfig(32, 128, 4, 4, 4, True), GemvConfig(64, 256, 4, 8, 3, True),
]


# deterministic mode at one row: Moondream 2's decoder GEMVs ([qkv | fc1] + GELU, the
# residual [proj | fc2]) summed in the megakernel's order (megakernel_backend.BEST's
# pipe_fma@8x1024 with 4 warps), so its bucket-1 passes are the fused deterministic step's
# bits and greedy decoding gives the same tokens (session 37, with the attention's splits
# merged in split order: decode_attention._merge). An FMA tile's sums follow its K step and
# warps only: at 1024 K and 4 warps every tile of 1-16 rows holds its [rows, 1024] products
# in one layout (8 per thread, 32 lanes, 4 warps along K; sm_90 builds, session 37), so
# the fused step takes the fastest of them. H200, b=1, us per call (bench/sweep_gemv.py,
# session 37 call 6): [qkv | fc1] 2 x 1024 with 2 stages 18.15 vs the 64 x 128 dot 17.89 (8 x
# 1024 22.61); the residual 2 x 1024 12.94 vs the 4 x 1024 tiles it had here before 16.22
# (split-K 12.78); the fused deterministic step 1.033 vs 1.126 ms with those (call 7)
MEGAKERNEL_ORDER_TILES = {(14336, 2048, EPI_QKV_GELU): GemvConfig(2, 1024, 1, 4, 2, False),
                          (2048, 10240, EPI_RESIDUAL): GemvConfig(2, 1024, 1, 4, 3, False)}
# split_k == 1 picks for deterministic=True (no fp32 atomics: the sum order is fixed, so the
# same inputs give the same bits on every run); bench/sweep_gemv.py on the H200: the residual
# GEMV 21.2 us at b=8 vs 14.8 us with split-K; at one row the MEGAKERNEL_ORDER_TILES above
TABLE_DETERMINISTIC: dict[tuple[int, int, int, bool], GemvConfig] = {
    **{(n, k, epi, True): c for (n, k, epi), c in MEGAKERNEL_ORDER_TILES.items()},
    (2048, 10240, EPI_RESIDUAL, False): GemvConfig(16, 512, 1, 4, 3, True),
}


# pick's rules for the shapes no table lists (PICK_RULES = False: DEFAULT / CANDIDATES only,
# as before session 10 - the A/B baseline). From bench/sweep_gemv_family.py on the H200 over
# Qwen 3.5 0.8B's and Gemma 4 E2B's decode GEMVs (docs/benchmarks.md, session 10 call 7):
# DEFAULT's 64-row tiles leave most SMs idle when N is a few thousand (N / 64 programs), so
# those steps' GEMVs took 1073 / 3161 us at b = 1 where the best config per shape takes 655
# / 1641. One row: the fma form with 2 rows x 1024 (K % 1024 == 0) or 4 x 512 / 4 x 256
# tiles below N = 8192 (N / 2 or N / 4 programs); several rows: 16-row dot tiles x 512 up to
# N = 2048 (split-K x 4 for a residual GEMV that may), 32 x 128 below N = 16384; DEFAULT
# from there (the lm heads: within 1 % of the best).
PICK_RULES = True


def _rule(b: int, n: int, k: int, epi: int, deterministic: bool) -> GemvConfig | None:
    if n >= 16384:
        return None
    if b == 1 and n < 8192:
        for bk, bn, warps in ((1024, 2, 4), (512, 4, 4), (256, 4, 2)):
            if k % bk == 0:
                return GemvConfig(bn, bk, 1, warps, 3, False)
        return None
    if n <= 2048:
        if epi == EPI_RESIDUAL and not deterministic and k % 512 == 0:
            return GemvConfig(16, 128, 4, 4, 3, True)
        bk = next((c for c in (512, 256, 128) if k % c == 0), None)
        return GemvConfig(16, bk, 1, 4, 3, True) if bk else None
    return GemvConfig(32, 128, 1, 4, 4, True) if k % 128 == 0 else None


def pick(b: int, n: int, k: int, epi: int, deterministic: bool = False) -> GemvConfig:
    table = TABLE_DETERMINISTIC if deterministic else TABLE
    cfg = table.get((n, k, epi, b == 1)) or (TABLE.get((n, k, epi, b == 1))
                                             if deterministic else None)
    if cfg is None and PICK_RULES:
        cfg = _rule(b, n, k, epi, deterministic)
    if cfg is not None and cfg.fits(b, n, k, epi) and not (deterministic and cfg.split_k > 1):
        return cfg
    for c in (DEFAULT, *CANDIDATES):
        if c.fits(b, n, k, epi) and not (deterministic and c.split_k > 1):
            return c
    for bk in (128, 64, 32, 16):
        c = GemvConfig(64, bk)
        if c.fits(b, n, k, epi):
            return c
    raise ValueError(f"no GEMV config fits n={n} k={k}")


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
         epi: int = EPI_STORE, n_split: int = 0, gap: int = 0,
         cfg: GemvConfig | None = None, deterministic: bool = False,
         pdl: bool = False, act: str = "gelu_tanh", mul: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x [b, K] (row stride free, unit column stride; may be fp32 with bf16 / fp16 weights:
    rounded as it is loaded), w [N, K] contiguous, y [b, *] with unit column stride (fp32
    for EPI_RESIDUAL; N / 2 columns for EPI_GATED).
    deterministic: never split K (split-K adds with fp32 atomics in a varying order).
    pdl: programmatic dependent launch (ops/pdl.py): the first weight tile loads while the
    previous kernel finishes.
    act: EPI_GATED / EPI_ACT_MUL's activation ("gelu_tanh" | "silu"); mul [b, N]: EPI_ACT_MUL's
    multiplier (unit column stride)."""
    b, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.is_contiguous() and x.stride(1) == 1 and y.stride(1) == 1
    assert b <= GEMV_MAX_ROWS
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, not {act!r}")
    if epi == EPI_ACT_MUL:
        assert mul is not None and mul.stride(1) == 1 and mul.shape[0] >= b
    mul = mul if mul is not None else y
    cfg = cfg or pick(b, n, k, epi, deterministic)
    assert cfg.fits(b, n, k, epi), (cfg, b, n, k, epi)
    block_b = 16 if cfg.dot else 1
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    shape, gdc, launch_kw = pdl_launch(pdl, w)
    tma = tma_weights(w, cfg)
    _gemv_kernel[grid](x, tma or w, bias if bias is not None else w, y, b, n, k,
                       x.stride(0), y.stride(0), n_split, gap, mul, mul.stride(0), EPI=epi,
                       HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK_B=block_b,
                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.dot, PDL=shape,
                       GDC=gdc, IEEE=w.dtype == torch.float32, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages,
                       ACT=ACT_SILU if act == "silu" else ACT_GELU_TANH,
                       LATE=gdc and _pdl.LATE_TRIGGER, TMA=tma is not None,
                       RELAXED=RELAXED_ATOMICS, **launch_kw)
    return y


def tma_capable(w: torch.Tensor) -> bool:
    """w lies on a Hopper-or-newer GPU (TMA "auto"'s hardware test; bench/compile_sm90.py
    replaces it to record the launches an H200 would make from CPU tensors)."""
    return w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9


def tma_weights(w: torch.Tensor, cfg: GemvConfig):
    """A TensorDescriptor of w in cfg's [block_n, block_k] tiles where the GEMV loads its
    weights by bulk tensor copies (TMA), else None: TMA "auto" for split-K tensor-core tiles
    of at least 16 KB (Moondream 2's residual GEMV at 2+ rows, 32 x 256: where it measured
    faster; Qwen 3.5's 16 x 128 ones lost) of bf16 / fp16 weights on a Hopper-or-newer GPU,
    "on" for any tile wherever Triton has host descriptors (the interpreter too: the tests),
    "off" never; and only where the copy engine takes the tile (each block side <= 256
    elements, 16-byte aligned base and rows)."""
    if TMA == "off" or TensorDescriptor is None:
        return None
    if TMA == "auto" and not (cfg.split_k > 1 and cfg.dot
                              and cfg.block_n * cfg.block_k * w.element_size() >= 16384
                              and w.dtype in (torch.bfloat16, torch.float16)
                              and tma_capable(w)):
        return None
    size = w.element_size()
    if (cfg.block_n > 256 or cfg.block_k > 256 or cfg.block_k * size < 16
            or w.data_ptr() % 16 or (w.stride(0) * size) % 16):
        return None
    return TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])


# -- torch references ---------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op: y = x W^T + b (a torch Linear)."""
    return F.linear(x, w, bias)


def linear_gelu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x W^T + b): a Linear followed by GELU (tanh form), rounded between them."""
    return F.gelu(F.linear(x, w, bias), approximate="tanh")


def interleave_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[N, ...] gate and up rows (weights or biases) -> [2N, ...] in (gate, up) row pairs, the
    layout EPI_GATED reads."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   y: torch.Tensor, epi: int = EPI_STORE, n_split: int = 0,
                   gap: int = 0, act: str = "gelu_tanh",
                   mul: torch.Tensor | None = None) -> torch.Tensor:
    """What gemv() writes into y, in torch (the kernel's test oracle)."""
    dt = y.dtype
    acc = F.linear(x.to(w.dtype).float(), w.float(), None if bias is None else bias.float())
    if epi in (EPI_GATED, EPI_ACT_MUL):
        t = acc.to(dt).float()
        g, u = (t[:, 0::2], t[:, 1::2]) if epi == EPI_GATED else (t, mul[:t.shape[0]].float())
        y[:, :g.shape[1]] = gated_activation(g, u, act).to(dt)
    elif epi == EPI_RESIDUAL:
        y[:, :acc.shape[1]] += acc
    elif epi == EPI_QKV_GELU:
        t = acc.to(dt)
        y[:, :n_split] = t[:, :n_split]
        y[:, n_split + gap:n_split + gap + t.shape[1] - n_split] = F.gelu(
            t[:, n_split:].float(), approximate="tanh").to(dt)
    else:
        y[:, :acc.shape[1]] = acc.to(dt)
    return y
