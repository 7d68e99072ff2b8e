"""The runtime's state cache for Gemma 4's step program (program.py), part of the local
runtime extension (backend_ext.py) until fast/static_kv_cache.py holds per-layer shapes:
per layer that writes k/v, k and v [rows, Hkv, S, D] with the layer's own head size;
S = the sliding window for "ring" layers (position p in slot p % S: a row keeps exactly its
window), S = capacity for "kv" (global) layers. KV-shared layers own nothing and read their
source layer's. Allocated once; rows are reused by tasks (stale slots are never read: see
ops/sliding_window_attention.py)."""
from __future__ import annotations

import torch

from ...ops.sliding_window_attention import state_slot


class Gemma4StateCache:
    def __init__(self, program, rows: int, capacity: int, device, dtype):
        self.rows, self.capacity = rows, capacity
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.ring: dict[int, bool] = {}
        for s in program.state:
            hkv, d = s.shape[0], s.shape[-1]
            ring = s.kind == "ring"
            n = min(s.shape[1], capacity) if ring else capacity
            self.k[s.layer] = torch.zeros(rows, hkv, n, d, device=device, dtype=dtype)
            self.v[s.layer] = torch.zeros(rows, hkv, n, d, device=device, dtype=dtype)
            self.ring[s.layer] = ring

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def load_prefix(self, row: int, k_layers, v_layers, length: int) -> int:
        """A prefix's k/v per layer ([Hkv, >= length, D] full-length tensors, None for
        KV-shared layers: the reference engine's KVCache.k / .v) into a row: a ring layer
        keeps the last S positions. Returns `length` (where the prompt starts)."""
        if length > self.capacity:
            raise ValueError(f"a {length}-token prefix does not fit the {self.capacity}-position "
                             "state cache")
        for layer, kc in self.k.items():
            n = kc.shape[2]
            p = torch.arange(max(0, length - n) if self.ring[layer] else 0, length,
                             device=kc.device)
            slots = state_slot(p, n, self.ring[layer])
            kc[row][:, slots] = k_layers[layer][:, p].to(kc.dtype)
            self.v[layer][row][:, slots] = v_layers[layer][:, p].to(kc.dtype)
        return length
