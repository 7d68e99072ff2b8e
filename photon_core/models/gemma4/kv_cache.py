"""Per-task k/v storage of the Gemma 4 decoder: one [Hkv, capacity, D] pair per layer that
computes k/v (the KV-shared last layers read their source layer's pair; they store nothing).

Sliding layers keep full-length storage too: the window is a mask on read (the decode op
reads only the last `sliding_window` positions), so the prefix copied from an encoded image
stays valid whatever its length. Head sizes differ per layer (global layers are wider).
"""
from __future__ import annotations

import torch

from .config import TextCfg


class KVCache:
    def __init__(self, cfg: TextCfg, capacity: int, device, dtype: torch.dtype):
        self.capacity = capacity
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for i in range(cfg.n_layers):
            if i < cfg.first_shared:
                shape = (cfg.kv_heads_of(i), capacity, cfg.head_dim_of(i))
                self.k.append(torch.zeros(shape, device=device, dtype=dtype))
                self.v.append(torch.zeros(shape, device=device, dtype=dtype))
            else:
                self.k.append(None)
                self.v.append(None)

    def write(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [Hkv, S, D] for positions pos0 .. pos0 + S - 1."""
        end = pos0 + k.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"k/v cache overflow: position {end - 1} >= capacity {self.capacity}")
        self.k[layer][:, pos0:end] = k
        self.v[layer][:, pos0:end] = v

    def load_prefix(self, prefix: "KVCache", length: int) -> None:
        for mine, theirs in ((self.k, prefix.k), (self.v, prefix.v)):
            for a, b in zip(mine, theirs):
                if a is not None:
                    a[:, :length] = b[:, :length]
