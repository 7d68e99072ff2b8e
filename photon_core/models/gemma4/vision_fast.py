"""Gemma 4's vision tower in a fast form for the GPU encode (FastEngine encoder "fast", the
default on CUDA): the math of vision.tower with fewer, larger kernels -

  - q | k | v and gate | up each one GEMM over weights concatenated once (per projection
    when the checkpoint's clipped linears clamp each projection's input differently);
  - attention by F.scaled_dot_product_attention (scale 1.0; flash / cuDNN on the GPU): the
    reference's fp32 score matrix [heads, N, N] and its softmax are never materialized
    (N = 2520 patches for a 640x480 frame: 12 x 2520^2 fp32 scores per layer);
  - the RMSNorms and the gated GELU by their Triton kernels on CUDA (text.FAST:
    ops/rmsnorm_scaled.py, ops/gelu_tanh_gate.py; the torch references elsewhere); q's and
    k's per-head norm and axial rotary as one launch each (ops/rotary_half.py's
    norm_rotary_triton, halves=2: ~0.85 ms of torch cat / mul launches in the 640x480
    encode before, session 16).

Not bitwise the reference (the attention's sums run in another order, bf16 probabilities
are not rounded from fp32 ones): diff-tested against vision.tower (fp32 on the CPU, bf16 on
the H200) in test_gemma4_fast.py / test_gemma4_fast_gpu.py. The patch embedding, rotary
tables, pooling, soft-token scale and projection are the reference's (vision.tower runs
this form's blocks).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ... import weight_layout
from .config import VisionCfg
from .text import fast_ops_on
from ...ops.rotary_half import axial_rotary, norm_rotary_triton
from .vision import _linear, tower
from .weights import vision_layer


# the tower's joined weights replace the model's entries where no graph reads them yet (the
# model holds them once); False: copies beside them (bench/bench_shared_weights.py's baseline)
SHARE_JOINED = True


class AxialTables(NamedTuple):
    """The vision rotary's tables as norm_rotary_triton(halves=2) reads them: [cx | cy] and
    [sx | sy] [N, D] (each half of a head its own angles) and the rows' indices into them."""
    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor


def axial_tables(cx, sx, cy, sy) -> AxialTables:
    """Made once per tower call (vision.tower's `rotary` hook), read by every layer."""
    return AxialTables(torch.cat([cx, cy], -1).contiguous(), torch.cat([sx, sy], -1).contiguous(),
                       torch.arange(cx.shape[0], device=cx.device))


class FastTower:
    """The tower's weights as the fast form reads them (concatenated once, on their device)
    and its forward: tower(patches, positions, grid) -> pooled soft tokens, as vision.tower."""

    def __init__(self, w: dict, cfg: VisionCfg, kernels: bool | None = None):
        """kernels: q / k's norm and axial rotary as one Triton launch each (None: on CUDA,
        for a power-of-two head size). The joined q | k | v and gate | up weights replace the
        model's own entries (views of them: the model holds them once) unless a CUDA graph or
        an engine may read those entries by address already (weight_layout.held): then
        they are copies beside them."""
        self.w, self.cfg, self.kernels = w, cfg, kernels
        self.qkv, self.gate_up = [], []
        if not cfg.clipped_linears:
            for j in range(cfg.n_layers):
                self.qkv.append(self._join(j, "self_attn.{}_proj.linear.weight", "qkv"))
                self.gate_up.append(self._join(j, "mlp.{}_proj.linear.weight", ("gate", "up")))

    def _join(self, j: int, pattern: str, parts) -> torch.Tensor:
        names = [vision_layer(j, pattern.format(n)) for n in parts]
        tensors = [self.w[n] for n in names]
        joined = weight_layout.join_weights(tensors, "rows")
        if SHARE_JOINED and not weight_layout.held(tensors):
            views = weight_layout.joined_views(joined, [t.shape for t in tensors], "rows")
            self.w.update(zip(names, views))
        return joined

    def _attention(self, j: int, h: torch.Tensor, rot) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        N, D = h.shape[0], cfg.head_dim
        nq, nk = cfg.n_heads * D, cfg.n_kv_heads * D
        if self.qkv:
            q, k, v = (h @ self.qkv[j].T).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = (_linear(w, cfg, j, f"self_attn.{n}_proj", h) for n in "qkv")
        norm = fast_ops_on(h).norm
        qw, kw = (w[vision_layer(j, f"self_attn.{n}_norm.weight")] for n in "qk")
        if isinstance(rot, AxialTables):         # per-head norm + axial rotary, one launch each
            q, k = (norm_rotary_triton(t, nw, rot.cos, rot.sin, rot.rows, D, cfg.eps,
                                       halves=2).view(N, -1, D)
                    for t, nw in ((q, qw), (k, kw)))
        else:
            q = axial_rotary(norm(q.reshape(N, -1, D), qw, cfg.eps), *rot)
            k = axial_rotary(norm(k.reshape(N, -1, D), kw, cfg.eps), *rot)
        v = norm(v.reshape(N, -1, D), None, cfg.eps)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))        # [1, heads, N, D]
        a = F.scaled_dot_product_attention(q, k, v, scale=1.0,
                                           enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        return _linear(w, cfg, j, "self_attn.o_proj", a[0].transpose(0, 1).reshape(N, -1))

    def _block(self, j: int, x: torch.Tensor, rot) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        ops = fast_ops_on(x)

        def norm(t, name):
            return ops.norm(t, w[vision_layer(j, name + ".weight")], cfg.eps)

        x = x + norm(self._attention(j, norm(x, "input_layernorm"), rot),
                     "post_attention_layernorm")
        h = norm(x, "pre_feedforward_layernorm")
        if self.gate_up:
            g, u = (h @ self.gate_up[j].T).chunk(2, dim=-1)
        else:
            g, u = (_linear(w, cfg, j, f"mlp.{n}_proj", h) for n in ("gate", "up"))
        m = ops.gate(g, u)
        return x + norm(_linear(w, cfg, j, "mlp.down_proj", m), "post_feedforward_layernorm")

    def __call__(self, patches: torch.Tensor, positions: torch.Tensor,
                 grid: tuple[int, int]) -> torch.Tensor:
        """vision.tower with this form's blocks (its embedding, rotary and pooling)."""
        d = self.cfg.head_dim
        fused = (patches.is_cuda if self.kernels is None else self.kernels) \
            and d & (d - 1) == 0
        return tower(self.w, self.cfg, patches, positions, grid, block=self._block,
                     rotary=axial_tables if fused else None)
