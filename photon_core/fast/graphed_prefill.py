"""The task prompt's prefill as CUDA graphs, one per prompt-length bucket (8 .. 128 tokens).

The eager prefill (the reference decoder over a handful of prompt tokens) is bound by kernel
launches (~600 of them, ~19 ms on the H200 for 8 tokens). Here the prompt is padded to its
bucket and run through a static-shape decoder over the row of the static KV cache:

  inputs (one device tensor, filled by ONE pinned async copy): row, start (= the image prefix
  length), real length, token ids padded with 0.
  positions start .. start+T-1; causal mask over the whole capacity (key <= query position);
  k/v written at (row, position); the hidden state of the last REAL token is the output.

Padding tokens sit after the real ones, so causality keeps them out of every real token's
result; their k/v land on positions that decode steps overwrite before anyone reads them.
Prompts longer than the largest bucket use the eager reference prefill. On the CPU the same
code runs eagerly (tests compare it with the reference).

With the fused decode step (fused_step.py, the default on CUDA in bf16/fp16), buckets of up to
FUSED_MAX_T (16) tokens run the projections with its kernels over the T token rows: LayerNorm
kernel, one GEMV over [Wqkv; Wfc1] (+ GELU), the attention below in torch, one GEMV over
[Wproj, Wfc2] into an fp32 residual stream - the weights are streamed once per layer at GEMV
speed instead of cuBLAS's small-M GEMMs and ~10 more launches per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.moondream2.rope import apply_rope, rope_angles
from .kernels import GEMV_MAX_ROWS

BUCKETS = (8, 16, 32, 64, 128)
FUSED_MAX_T = GEMV_MAX_ROWS   # prompt tokens the fused GEMV takes in one pass


class GraphedPrefill:
    def __init__(self, state, use_graphs: bool):
        self.state = state
        st = state
        self.use_graphs = use_graphs
        cap = st.kv.capacity
        self.buckets = tuple(b for b in BUCKETS if b < cap)
        tmax = self.buckets[-1]
        dev = st.hidden.device
        self.meta = torch.zeros(3 + tmax, dtype=torch.long, device=dev)
        self.hidden_out = torch.zeros(st.cfg.text.dim, device=dev, dtype=st.hidden.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # None: the torch projections for every bucket; else the fused decoder's kernels and
        # its scratch (x, h, u; free between decode steps, all on one stream)
        self.fused = st.fused
        self.capture_stream = None   # set by FastEngine: its own stream (fast_engine.py)

    def bucket(self, length: int) -> int | None:
        for b in self.buckets:
            if b >= length:
                return b
        return None

    def _run(self, T: int) -> None:
        st = self.state
        w, cfg, kv = st.w, st.cfg.text, st.kv
        hd, nh, nkv, dim = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.dim
        row, start, length = self.meta[0:1], self.meta[1:2], self.meta[2:3]
        ids = self.meta[3:3 + T]
        x = F.embedding(ids, w["text.wte"])[None]                       # [1, T, dim]
        fd = self.fused if T <= FUSED_MAX_T else None
        if fd is not None:
            from .kernels.gemv import EPI_QKV_GELU, EPI_RESIDUAL, gemv
            from .kernels.layernorm import layer_norm
            fx, fh, fu = fd.x[:T], fd.h[:T], fd.u[:T]
            fx.copy_(x[0])
        pos = start + st.key_ids[:T]
        cos, sin = rope_angles(pos, cfg.rot_dim)
        pos_w = pos.clamp(max=kv.capacity - 1)
        mask_add = torch.zeros(T, kv.capacity, device=x.device, dtype=torch.float32).masked_fill(
            st.key_ids[None, :] > pos[:, None], float("-inf"))
        rep = nh // nkv
        for i in range(cfg.n_layers):
            p = f"text.blocks.{i}"
            if fd is not None:
                layer_norm(fx, *fd.ln[i], fh)
                gemv(fh, fd.w1[i], fd.b1[i], fu, EPI_QKV_GELU, n_split=fd.n_qkv, gap=nh * hd)
                qkv = fu[None, :, :fd.n_qkv]
            else:
                h = w.layer_norm(x, p + ".ln")
                qkv = w.linear(h, p + ".attn.qkv")
            qk = apply_rope(qkv[..., :(nh + nkv) * hd].view(1, T, nh + nkv, hd).transpose(1, 2),
                            cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[..., (nh + nkv) * hd:].view(1, T, nkv, hd).transpose(1, 2)
            kc, vc = kv.data[i, 0], kv.data[i, 1]
            kc[row, :, pos_w] = k[0].transpose(0, 1)
            vc[row, :, pos_w] = v[0].transpose(0, 1)
            keys, values = kc.index_select(0, row), vc.index_select(0, row)  # [1, Hkv, C, D]
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=1)
                values = values.repeat_interleave(rep, dim=1)
            scores = torch.matmul(q, keys.transpose(-1, -2)).float() * hd ** -0.5 + mask_add
            a = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
            if fd is not None:
                fu[:, fd.n_qkv:fd.n_qkv + dim].copy_(a[0].transpose(0, 1).reshape(T, dim))
                gemv(fu[:, fd.n_qkv:], fd.w2[i], fd.b2[i], fx, EPI_RESIDUAL,
                     deterministic=fd.deterministic)
                continue
            a = w.linear(a.transpose(1, 2).reshape(1, T, dim), p + ".attn.proj")
            x = x + a + w.mlp(h, p + ".mlp")
        last = fx if fd is not None else x[0]
        self.hidden_out.copy_(last.index_select(0, length - 1)[0])

    def capture(self) -> None:
        """Capture every bucket (at engine warm-up, before any row is in use: the capture
        runs write k/v of row 0)."""
        if not self.use_graphs or self.graphs:
            return
        self.meta.zero_()
        self.meta[2] = 1
        side = self.capture_stream or torch.cuda.Stream()   # warm-up
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                for T in self.buckets:
                    self._run(T)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for T in self.buckets:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=self.capture_stream):
                    self._run(T)
                self.graphs[T] = g
        torch.cuda.synchronize()

    def run(self, row: int, start: int, prompt: list[int]) -> torch.Tensor:
        """Prefill `prompt` at positions start.. of `row`; returns the last hidden state
        (a static buffer: copy it before the next prefill)."""
        T = self.bucket(len(prompt))
        meta = torch.tensor([row, start, len(prompt)] + list(prompt), dtype=torch.long)
        if self.meta.is_cuda:
            meta = meta.pin_memory()
        self.meta[:meta.numel()].copy_(meta, non_blocking=True)
        g = self.graphs.get(T)
        if g is not None:
            g.replay()
        else:
            self._run(T)
        return self.hidden_out
