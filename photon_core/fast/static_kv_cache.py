"""Static, preallocated KV cache shared by the batch slots (rows) of the fast path.

One tensor [n_layers, 2, rows, n_kv_heads, capacity, head_dim], allocated once when the
engine is built. A task owns one row from start() until its last in-flight step is
committed (zombie_refcount.py). Nothing is allocated per step: a decode step writes each
row's new k/v at that row's own position (an index write with device-side positions, so it
can be captured in a CUDA graph) and attends over the first `attn_len` positions of rows
[0, bucket) with a per-row mask (key index <= position).
"""
from __future__ import annotations

import torch

from ..models.moondream2.kv_cache import KVCache


class StaticKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, rows: int, capacity: int,
                 head_dim: int, device, dtype):
        self.data = torch.zeros(n_layers, 2, rows, n_kv_heads, capacity, head_dim,
                                device=device, dtype=dtype)
        self.rows, self.capacity = rows, capacity

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def row_cache(self, row: int) -> KVCache:
        """A reference-path KVCache whose storage is a view of one row: the prefill runs the
        reference decoder (text.decoder) unchanged and writes straight into the static cache."""
        view = KVCache.__new__(KVCache)
        view.data = self.data[:, :, row:row + 1]
        view.length = 0
        return view

    def write_step(self, layer: int, rows: torch.Tensor, pos: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [b, Hkv, D] of one decode step into rows `rows` [b] at positions `pos` [b]
        (device tensors, already clamped to capacity - 1)."""
        kc, vc = self.data[layer, 0], self.data[layer, 1]
        kc[rows, :, pos] = k
        vc[rows, :, pos] = v

    def keys_values(self, layer: int, bucket: int, attn_len: int):
        """[bucket, Hkv, attn_len, D] views of the keys and values of rows [0, bucket)."""
        return (self.data[layer, 0, :bucket, :, :attn_len],
                self.data[layer, 1, :bucket, :, :attn_len])
