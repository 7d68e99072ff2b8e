"""A preallocated key/value cache for one sequence.

k and v live in one tensor [n_layers, 2, 1, n_kv_heads, capacity, head_dim], allocated once
when a task starts (capacity = image prefix + prompt + the most decode steps the task may
take, capped at max_context). Writing position p never moves other entries, so decoding is
an index write plus attention over [0, p].
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int,
                 device, dtype):
        self.data = torch.zeros(n_layers, 2, 1, n_kv_heads, capacity, head_dim,
                                device=device, dtype=dtype)
        self.length = 0   # positions [0, length) hold valid entries

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [1, Hkv, T, D] at positions start..start+T-1 and return the cached
        k/v covering [0, start + T)."""
        end = start + k.shape[2]
        self.data[layer, 0, :, :, start:end] = k
        self.data[layer, 1, :, :, start:end] = v
        return self.data[layer, 0, :, :, :end], self.data[layer, 1, :, :, :end]

    def load_prefix(self, prefix: torch.Tensor) -> None:
        """Copy a shared [n_layers, 2, 1, Hkv, P, D] prefix (the encoded image) in."""
        self.data[:, :, :, :, :prefix.shape[4]] = prefix
        self.length = prefix.shape[4]
