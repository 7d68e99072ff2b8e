"""Static, preallocated state cache shared by the batch slots (rows) of the fast path: the
attention layers' k/v, and a fixed-size row per declared row state (the program's LayerState
"recurrent" / "conv", e.g. Gated DeltaNet's fp32 delta-rule state and its conv inputs; none
for Moondream 2).

One tensor [n_layers, 2, rows, n_kv_heads, capacity, head_dim], allocated once when the
engine is built. A task owns one row from start() until its last in-flight step is
committed (zombie_refcount.py). Nothing is allocated per step: a decode step writes each
row's new k/v at that row's own position (an index write with device-side positions, so it
can be captured in a CUDA graph) and attends over the first `attn_len` positions of rows
[0, bucket) with a per-row mask (key index <= position).

Layers of their own shapes (a program whose "kv" states carry a shape, or "ring" states:
Gemma 4's sliding layers at 256-wide heads in rings of `window` slots, its global layers at
512-wide heads over the capacity): one k and one v tensor per layer [rows, Hkv, S, D]
(`k[layer]`, `v[layer]`, `ring[layer]`; `data` is None). A uniform cache has the same
per-layer views into `data`. A ring layer's prefix keeps its last S positions (slot p % S).
"""
from __future__ import annotations

import torch

from ..ops.kv_block_copy import kv_block_copy


class StaticKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, rows: int, capacity: int,
                 head_dim: int, device, dtype, recurrent_shapes: tuple = (),
                 recurrent_dtypes: tuple = (), recurrent_keys: tuple = ()):
        """n_layers: attention layers; recurrent_shapes: per row state (recurrent / conv), the
        shape of its state (one row each), in the program's order; recurrent_dtypes: their
        dtypes (default the cache's); recurrent_keys: their (kind, layer)."""
        self.data = torch.zeros(n_layers, 2, rows, n_kv_heads, capacity, head_dim,
                                device=device, dtype=dtype) if n_layers else None
        self.device, self.dtype = torch.device(device), dtype
        self.layers: tuple[int, ...] = tuple(range(n_layers))   # attention layers, in order
        # per attention layer: k, v [rows, Hkv, S, D] (views of data here), ring or not
        self.k = {i: self.data[i, 0] for i in range(n_layers)}
        self.v = {i: self.data[i, 1] for i in range(n_layers)}
        self.ring = {i: False for i in range(n_layers)}
        dts = tuple(recurrent_dtypes) or (None,) * len(recurrent_shapes)
        self.recurrent = [torch.zeros(rows, *shape, device=device, dtype=dt or dtype)
                          for shape, dt in zip(recurrent_shapes, dts)]
        # (kind, layer) -> the row-state tensor [rows, *shape]
        self.states = dict(zip(recurrent_keys, self.recurrent))
        self.rows, self.capacity = rows, capacity

    @classmethod
    def for_program(cls, program, rows: int, capacity: int, device, dtype) -> "StaticKVCache":
        """The cache a step program's declared state needs (photon_core.program.LayerState)."""
        a = program.attention
        rs = program.row_states
        dts = tuple(torch.float32 if s.dtype == "fp32" else None for s in rs)
        att = program.attention_states
        per_layer = any(s.kind == "ring" or s.shape for s in att)
        cache = cls(0 if per_layer else len(program.kv_layers), a.n_kv_heads, rows, capacity,
                    a.head_dim, device, dtype, tuple(s.shape for s in rs), dts,
                    tuple((s.kind, s.layer) for s in rs))
        if per_layer:
            cache._per_layer(att)
        return cache

    def _per_layer(self, states) -> None:
        """One k and one v tensor per attention layer, of the layer's own shape (keyed by the
        model layer): "ring" (Hkv, window, D) -> min(window, capacity) slots, "kv" (Hkv, D)
        -> capacity slots."""
        self.layers = tuple(s.layer for s in states)
        self.k, self.v, self.ring = {}, {}, {}
        for s in states:
            ring = s.kind == "ring"
            hkv, d = s.shape[0], s.shape[-1]
            n = min(s.shape[1], self.capacity) if ring else self.capacity
            for store in (self.k, self.v):
                store[s.layer] = torch.zeros(self.rows, hkv, n, d, device=self.device,
                                             dtype=self.dtype)
            self.ring[s.layer] = ring

    def load_prefix(self, row: int, prefix) -> int:
        """Copy a PrefixState (photon_core.engine) into a row: its k/v at positions [0, T) of
        every attention layer, its recurrent state into every recurrent layer's row.
        Returns T, where the prompt starts. A per-layer cache takes kv as a sequence of
        [2, 1, Hkv, T, D] per attention layer (in the program's order)."""
        if prefix.kv is not None and self.data is None:
            self._load_layers(row, prefix.kv)
        elif prefix.kv is not None:
            t = prefix.kv.shape[4]
            if t > self.capacity:
                raise ValueError(f"a {t}-token prefix does not fit the {self.capacity}-position "
                                 "state cache")
            kv_block_copy(self.data[:, :, row:row + 1, :, :t], prefix.kv)
        if len(prefix.recurrent) != len(self.recurrent):
            raise ValueError(f"the prefix has {len(prefix.recurrent)} recurrent states, the "
                             f"program {len(self.recurrent)}")
        dsts = [dst[row] for dst in self.recurrent]
        if dsts:            # one multi-tensor copy (Qwen 3.5: 36 row states), not one per state
            torch._foreach_copy_(dsts, [s.reshape(d.shape) for d, s in
                                        zip(dsts, prefix.recurrent)])
        return prefix.length

    def _load_layers(self, row: int, kv) -> None:
        if len(kv) != len(self.layers):
            raise ValueError(f"the prefix has k/v of {len(kv)} layers, the program "
                             f"{len(self.layers)}")
        for layer, t in zip(self.layers, kv):
            n_pos = t.shape[-2]
            if n_pos > self.capacity:
                raise ValueError(f"a {n_pos}-token prefix does not fit the {self.capacity}-"
                                 "position state cache")
            kc = self.k[layer]
            n = kc.shape[2]
            if self.ring[layer]:                 # the last n positions, slot p % n
                p = torch.arange(max(0, n_pos - n), n_pos, device=kc.device)
                slots = torch.remainder(p, n)
                kc[row][:, slots] = t[0, 0][:, p].to(kc.dtype)
                self.v[layer][row][:, slots] = t[1, 0][:, p].to(kc.dtype)
            else:       # (torch copy_: a Triton launch per layer cost Qwen 3.5 0.81 -> 0.86 ms)
                kc[row][:, :n_pos].copy_(t[0, 0])
                self.v[layer][row][:, :n_pos].copy_(t[1, 0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values())
                   ) if self.data is None else self.data.numel() * self.data.element_size()

    def row_view(self, row: int) -> torch.Tensor:
        """The k/v of one row, [n_layers, 2, 1, Hkv, capacity, D] (a view: a family's
        reference prefill can write straight into the static cache)."""
        return self.data[:, :, row:row + 1]

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
