"""Seeded sampling inside the CUDA graph: one categorical draw per row, reproducible from the
row's seed and position.

torch.multinomial in a graph draws from the process's CUDA generator, so a task's `seed`
could not be honoured on the GPU. Here row r draws

    token = argmax_i  p[r, i] / E_i,   E_i = -log(u_i),  u_i = philox(seed[r], pos[r] * V + i)

(the exponential race: E_i / p_i are exponentials with rates p_i, the smallest wins with
probability p_i / sum p, so the token follows p exactly). The uniforms are Triton's Philox
(tl.rand) keyed by the row's seed, counted by position: a row's uniforms do not depend on
the batch or on the other rows, so the same seed, prompt and image give the same tokens
whenever the probabilities are the same bits. On the fused bf16/fp16 step that takes
deterministic=True (the default split-K GEMV adds with fp32 atomics, so the logits' last bits
vary from run to run and a near-tie can go either way) and the same batch bucket (batch 1 and
larger buckets use different GEMV forms, so their logits differ in the last bits). (Not the
same tokens as the CPU path's torch.Generator for that seed: the two paths use different
random streams.) Rows with p = 0 never win; p comes in already tempered and top-p filtered.
"""
from __future__ import annotations

import torch
from ._triton import tl, triton


@triton.jit
def _race_kernel(p_ptr, stride_p, V, seed_ptr, pos_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    base = tl.load(pos_ptr + row).to(tl.int32) * V
    best = tl.full([], -1.0, tl.float32)
    best_i = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        p = tl.load(p_ptr + row * stride_p + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.rand(seed, base + offs)
        e = -tl.log(tl.maximum(u, 1e-30))      # u == 0 would give inf; clamp keeps it finite
        score = tl.where(ok, p / e, -1.0)
        m = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0).to(tl.int64) + start
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row, best_i)


def seeded_sample(probs: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor,
                  out: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """probs [b, V] (fp32, rows sum to 1), seed [b] int64, pos [b] int64 -> out [b] int64."""
    b, v = probs.shape
    assert probs.stride(1) == 1 and out.is_contiguous()
    block = min(block, triton.next_power_of_2(v))
    _race_kernel[(b,)](probs, probs.stride(0), v, seed, pos, out, BLOCK=block,
                       num_warps=8 if block >= 4096 else 4)
    return out
