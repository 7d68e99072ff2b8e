"""The decoder part of a decode step with fused Triton kernels (kernels/): 4 launches per
block instead of ~23, and a GEMV that streams the weights at (near) copy bandwidth.

Per block (Phi parallel block, h = x + attn(LN(x)) + mlp(LN(x))), over the bucket's rows:
  1. layernorm:   h = LN(x)                       (x: the fp32 residual stream)
                  or folded into step 2 (FOLD_LN, off by default: measured slower on the
                  H200): every GEMV program computes the row statistics of x itself and
                  normalizes x on the fly while streaming K
  2. gemv W1:     u[:, qkv] = h Wqkv^T + bqkv ;  u[:, g] = gelu_tanh(h Wfc1^T + bfc1)
                  (W1 = [Wqkv; Wfc1], one weight stream)
  3. attention:   rotary on q/k, k/v written into the static cache at the row's position,
                  split-sequence softmax partials over keys <= position
  4. combine:     u[:, a] = attention output (the splits merged)
  5. gemv W2:     x += [a | g] [Wproj | Wfc2]^T + (bproj + bfc2)   (W2 = [Wproj, Wfc2])
The u buffer is laid out [qkv | a | g] so that [a | g] is one contiguous K range.
The lm head's post_ln is folded into its GEMV the same way.

Numerics differ from the reference path by the fp32 residual stream (the reference rounds x
to the model dtype after every block) and the summation order; the GPU bench diffs the
outputs against the cuBLAS step. The weights W1 / W2 are copies (the reference path keeps
its own), built once.
"""
from __future__ import annotations

import os

import torch

from ..moondream.rope import rope_angles
from .kernels.decode_attention import AttentionScratch, decode_attention
from .kernels.gemv import EPI_QKV_GELU, EPI_RESIDUAL, EPI_STORE, gemv
from .kernels.layernorm import layer_norm

ATTN_CHUNK = 128     # measured on the H200: 7.3 us/layer at b=1 vs 8.1 (64), 9.3 (32)
# LayerNorm folded into the GEMV that consumes it (per-block LN and the lm head's post_ln).
# Off by default: on the H200 the folded GEMV made the batch-1 step 1.50 ms vs 1.09 ms with
# the separate layernorm kernel (docs/benchmarks.md). PHOTON_FOLD_LN=1 turns it on; read when
# a FusedDecoder is built.
FOLD_LN = os.environ.get("PHOTON_FOLD_LN", "0") == "1"


class FusedDecoder:
    def __init__(self, model, rows: int, kv, attn_chunk: int = ATTN_CHUNK,
                 fold_ln: bool | None = None):
        cfg, w = model.config.text, model.weights
        dev, dt = w.device, w.dtype
        self.cfg, self.kv, self.rows = cfg, kv, rows
        self.fold_ln = FOLD_LN if fold_ln is None else fold_ln
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.n_qkv = (nh + 2 * nkv) * hd
        self.w1, self.b1, self.w2, self.b2, self.ln = [], [], [], [], []
        for i in range(cfg.n_layers):
            p = f"text.blocks.{i}"
            self.w1.append(torch.cat([w[p + ".attn.qkv.weight"], w[p + ".mlp.fc1.weight"]]
                                     ).contiguous())
            self.b1.append(torch.cat([w[p + ".attn.qkv.bias"], w[p + ".mlp.fc1.bias"]]))
            self.w2.append(torch.cat([w[p + ".attn.proj.weight"], w[p + ".mlp.fc2.weight"]],
                                     dim=1).contiguous())
            self.b2.append(w[p + ".attn.proj.bias"].float() + w[p + ".mlp.fc2.bias"].float())
            self.ln.append((w[p + ".ln.weight"].contiguous(), w[p + ".ln.bias"].contiguous()))
        self.post_ln = (w["text.post_ln.weight"].contiguous(),
                        w["text.post_ln.bias"].contiguous())
        self.lm_w, self.lm_b = w["text.lm_head.weight"], w["text.lm_head.bias"]
        n_table = kv.capacity + 1
        self.cos, self.sin = (t.contiguous() for t in rope_angles(
            torch.arange(n_table, device=dev), cfg.rot_dim))
        self.x = torch.zeros(rows, cfg.dim, device=dev, dtype=torch.float32)
        self.h = torch.zeros(rows, cfg.dim, device=dev, dtype=dt)
        self.u = torch.zeros(rows, self.n_qkv + nh * hd + cfg.ff_dim, device=dev, dtype=dt)
        self.logits = torch.zeros(rows, cfg.vocab_size, device=dev, dtype=dt)
        self.scratch = AttentionScratch(rows, nh, hd, kv.capacity, attn_chunk, dev)

    def decoder(self, x_in: torch.Tensor, pos: torch.Tensor, b: int) -> torch.Tensor:
        """x_in [b, dim] (model dtype) at positions pos [b] through all blocks (k/v into the
        static cache); returns the fp32 residual stream [b, dim] (a view of a buffer)."""
        cfg = self.cfg
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        x, h, u = self.x[:b], self.h[:b], self.u[:b]
        x.copy_(x_in)
        a_off = self.n_qkv
        for i in range(cfg.n_layers):
            if self.fold_ln:
                gemv(x, self.w1[i], self.b1[i], u, EPI_QKV_GELU, n_split=self.n_qkv,
                     gap=nh * hd, ln=self.ln[i])
            else:
                layer_norm(x, *self.ln[i], h)
                gemv(h, self.w1[i], self.b1[i], u, EPI_QKV_GELU, n_split=self.n_qkv,
                     gap=nh * hd)
            kc, vc = self.kv.data[i, 0], self.kv.data[i, 1]
            decode_attention(u, pos, self.cos, self.sin, kc, vc, u[:, a_off:], self.scratch,
                             nh, nkv, hd)
            gemv(u[:, a_off:], self.w2[i], self.b2[i], x, EPI_RESIDUAL)
        return x

    def lm_logits(self, hidden: torch.Tensor, b: int) -> torch.Tensor:
        """post_ln + lm_head of hidden [b, dim] -> logits [b, vocab] (a view of a buffer)."""
        if self.fold_ln:
            return gemv(hidden, self.lm_w, self.lm_b, self.logits[:b], EPI_STORE,
                        ln=self.post_ln)
        h = self.h[:b]
        layer_norm(hidden, *self.post_ln, h)
        return gemv(h, self.lm_w, self.lm_b, self.logits[:b], EPI_STORE)
