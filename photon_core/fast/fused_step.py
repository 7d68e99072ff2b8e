"""The decoder part of a decode step with fused Triton kernels (kernels/): 4 launches per
block instead of ~23, and a GEMV that streams the weights at (near) copy bandwidth.

Per block (Phi parallel block, h = x + attn(LN(x)) + mlp(LN(x))), over the bucket's rows:
  1. layernorm:   h = LN(x)                       (x: the fp32 residual stream)
  2. gemv W1:     u[:, qkv] = h Wqkv^T + bqkv ;  u[:, g] = gelu_tanh(h Wfc1^T + bfc1)
                  (W1 = [Wqkv; Wfc1], one weight stream)
  3. attention:   rotary on q/k, k/v written into the static cache at the row's position,
                  split-sequence softmax partials over keys <= position
  4. combine:     u[:, a] = attention output (the splits merged)
  5. gemv W2:     x += [a | g] [Wproj | Wfc2]^T + (bproj + bfc2)   (W2 = [Wproj, Wfc2])
The u buffer is laid out [qkv | a | g] so that [a | g] is one contiguous K range.

Around the blocks, the step's glue is one launch each instead of ~40 small torch kernels:
feed() (the sampled token / coordinate / size -> next input embedding, by phase),
advance() (hidden, position, phase of the active rows), lm_greedy() (lm head GEMV + masked
argmax) and region_head() (the coord / size MLP as two GEMVs + argmax).

Numerics differ from the reference path by the fp32 residual stream (the reference rounds x
to the model dtype after every block) and the summation order; the GPU bench diffs the
outputs against the cuBLAS step. The weights W1 / W2 are copies (the reference path keeps
its own), built once.
"""
from __future__ import annotations

import torch

from ..models.moondream2.rope import rope_angles
from .kernels import GEMV_MAX_ROWS
from .kernels.decode_attention import AttentionScratch, decode_attention
from .kernels.feedback_embedding import FeedbackWeights, feedback_embedding
from .kernels.gemv import EPI_QKV_GELU, EPI_RESIDUAL, EPI_STORE, gemv
from .kernels.layernorm import layer_norm
from .kernels.masked_argmax import masked_argmax
from .kernels.row_advance import row_advance

ATTN_CHUNK = 128     # measured on the H200: 7.3 us/layer at b=1 vs 8.1 (64), 9.3 (32)


class FusedDecoder:
    def __init__(self, model, rows: int, kv, attn_chunk: int = ATTN_CHUNK,
                 coord_table: torch.Tensor | None = None,
                 size_table: torch.Tensor | None = None, deterministic: bool = False):
        cfg, w = model.config.text, model.weights
        dev, dt = w.device, w.dtype
        self.cfg, self.kv, self.rows = cfg, kv, rows
        # no split-K GEMV (its fp32 atomics add in a varying order): bitwise repeatable steps
        self.deterministic = deterministic
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
        # scratch of one pass through the blocks, for up to GEMV_MAX_ROWS rows: a decode
        # step's bucket, or the tokens of a short prompt (graphed_prefill.py uses it too)
        n = max(rows, GEMV_MAX_ROWS)
        self.x = torch.zeros(n, cfg.dim, device=dev, dtype=torch.float32)
        self.h = torch.zeros(n, cfg.dim, device=dev, dtype=dt)
        self.u = torch.zeros(n, self.n_qkv + nh * hd + cfg.ff_dim, device=dev, dtype=dt)
        self.logits = torch.zeros(rows, cfg.vocab_size, device=dev, dtype=dt)
        self.scratch = AttentionScratch(rows, nh, hd, kv.capacity, attn_chunk, dev)
        # step glue (feedback in, state advance out, greedy picks) and the region heads
        self.feedback = (FeedbackWeights(w, coord_table, size_table)
                         if coord_table is not None else None)
        self.heads = {}
        for name in ("coord", "size"):
            p = f"region.{name}_decoder"
            self.heads[name] = (w[p + ".fc1.weight"].contiguous(), w[p + ".fc1.bias"],
                                w[p + ".fc2.weight"].contiguous(), w[p + ".fc2.bias"])
        ff = max(t[0].shape[0] for t in self.heads.values())
        n_out = max(t[2].shape[0] for t in self.heads.values())
        self.head_h = torch.zeros(rows, ff, device=dev, dtype=dt)
        self.head_out = torch.zeros(rows, n_out, device=dev, dtype=dt)

    def decoder(self, x_in: torch.Tensor | None, pos: torch.Tensor, b: int) -> torch.Tensor:
        """x_in [b, dim] (model dtype; None: already in self.x, e.g. from feed()) at
        positions pos [b] through all blocks (k/v into the static cache); returns the fp32
        residual stream [b, dim] (a view of a buffer)."""
        cfg = self.cfg
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        x, h, u = self.x[:b], self.h[:b], self.u[:b]
        if x_in is not None:
            x.copy_(x_in)
        a_off = self.n_qkv
        for i in range(cfg.n_layers):
            layer_norm(x, *self.ln[i], h)
            gemv(h, self.w1[i], self.b1[i], u, EPI_QKV_GELU, n_split=self.n_qkv, gap=nh * hd)
            kc, vc = self.kv.data[i, 0], self.kv.data[i, 1]
            decode_attention(u, pos, self.cos, self.sin, kc, vc, u[:, a_off:], self.scratch,
                             nh, nkv, hd)
            gemv(u[:, a_off:], self.w2[i], self.b2[i], x, EPI_RESIDUAL,
                 deterministic=self.deterministic)
        return x

    def lm_logits(self, hidden: torch.Tensor, b: int) -> torch.Tensor:
        """post_ln + lm_head of hidden [b, dim] -> logits [b, vocab] (a view of a buffer)."""
        h = self.h[:b]
        layer_norm(hidden, *self.post_ln, h)
        return gemv(h, self.lm_w, self.lm_b, self.logits[:b], EPI_STORE)

    # -- step glue: one launch each (kernels/feedback_embedding.py, row_advance.py,
    #    masked_argmax.py) instead of ~40 small torch kernels per step
    def feed(self, out: torch.Tensor, phase: torch.Tensor, b: int) -> None:
        """GPU-resident feedback: each row's next input embedding into the residual x."""
        feedback_embedding(self.feedback, out[:b], phase[:b], self.x[:b])

    def advance(self, st, b: int) -> None:
        """hidden / pos / phase / first of the active rows, from the decoder output in x."""
        row_advance(self.x[:b], st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                    st.is_detect[:b], st.first[:b])

    def lm_greedy(self, hidden: torch.Tensor, out: torch.Tensor, phase: torch.Tensor,
                  first: torch.Tensor, answer_id: int, b: int) -> None:
        """out[:, 0] = argmax of the lm logits, the answer marker masked after the first
        text pick (decode_step._lm_logits' rule)."""
        masked_argmax(self.lm_logits(hidden, b), out, 0, mask_col=answer_id,
                      phase=phase[:b], first=first[:b])

    def region_head(self, name: str, hidden: torch.Tensor, out: torch.Tensor, col0: int,
                    segments: int, b: int) -> None:
        """coord (1 segment) or size (2: width, height) head: fc2(gelu(fc1(hidden))) as two
        GEMVs, then the argmax of each segment into out[:, col0:]."""
        w1, b1, w2, b2 = self.heads[name]
        g, y = self.head_h[:b, :w1.shape[0]], self.head_out[:b, :w2.shape[0]]
        gemv(hidden, w1, b1, g, EPI_QKV_GELU, n_split=0, gap=0)
        gemv(g, w2, b2, y, EPI_STORE)
        masked_argmax(y, out, col0, segments=segments)
