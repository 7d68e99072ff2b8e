"""A preallocated key/value cache for one sequence.

k and v live in one tensor [n_layers, 2, 1, n_kv_heads, capacity, head_dim], allocated once
(a task allocates the whole max_context, like the reference implementation, because the
decoder attends over that span with a mask: text.py; the image-prefix cache holds just the
prefix). Writing position p never moves other entries, so decoding is an index write plus
masked attention over the span.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int,
                 device, dtype):
        self.data = torch.zeros(n_layers, 2, 1, n_kv_heads, capacity, head_dim,
                                device=device, dtype=dtype)
        self.length = 0   # positions [0, length) hold valid entries

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor,
              span: int | None = None):
        """Store k/v [1, Hkv, T, D] at positions start..start+T-1 and return the cached
        k/v covering [0, span) (default [0, start + T)); positions beyond the storage read
        as zeros (a padded copy: callers mask them out)."""
        end = start + k.shape[2]
        self.data[layer, 0, :, :, start:end] = k
        self.data[layer, 1, :, :, start:end] = v
        span = end if span is None else span
        keys, values = self.data[layer, 0, :, :, :span], self.data[layer, 1, :, :, :span]
        if keys.shape[2] < span:
            pad = (0, 0, 0, span - keys.shape[2])
            keys, values = F.pad(keys, pad), F.pad(values, pad)
        return keys, values

    def load_prefix(self, prefix: torch.Tensor) -> None:
        """Copy a shared [n_layers, 2, 1, Hkv, P, D] prefix (the encoded image) in."""
        self.data[:, :, :, :, :prefix.shape[4]] = prefix
        self.length = prefix.shape[4]
