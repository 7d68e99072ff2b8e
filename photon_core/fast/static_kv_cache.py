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
"""
from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, rows: int, capacity: int,
                 head_dim: int, device, dtype, recurrent_shapes: tuple = (),
                 recurrent_dtypes: tuple = (), recurrent_keys: tuple = ()):
        """n_layers: attention layers; recurrent_shapes: per row state (recurrent / conv), the
        shape of its state (one row each), in the program's order; recurrent_dtypes: their
        dtypes (default the cache's); recurrent_keys: their (kind, layer)."""
        self.data = torch.zeros(n_layers, 2, rows, n_kv_heads, capacity, head_dim,
                                device=device, dtype=dtype)
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
        return cls(len(program.kv_layers), a.n_kv_heads, rows, capacity, a.head_dim, device,
                   dtype, tuple(s.shape for s in rs), dts, tuple((s.kind, s.layer) for s in rs))

    def load_prefix(self, row: int, prefix) -> int:
        """Copy a PrefixState (photon_core.engine) into a row: its k/v at positions [0, T) of
        every attention layer, its recurrent state into every recurrent layer's row.
        Returns T, where the prompt starts."""
        if prefix.kv is not None:
            t = prefix.kv.shape[4]
            if t > self.capacity:
                raise ValueError(f"a {t}-token prefix does not fit the {self.capacity}-position "
                                 "state cache")
            self.data[:, :, row:row + 1, :, :t] = prefix.kv
        if len(prefix.recurrent) != len(self.recurrent):
            raise ValueError(f"the prefix has {len(prefix.recurrent)} recurrent states, the "
                             f"program {len(self.recurrent)}")
        for dst, src in zip(self.recurrent, prefix.recurrent):
            dst[row].copy_(src.reshape(dst.shape[1:]))
        return prefix.length

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

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
