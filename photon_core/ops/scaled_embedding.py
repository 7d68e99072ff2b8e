"""Scaled token embedding: table[id] * scale, the scale rounded to the table's dtype first (as
transformers' Gemma scaled embeddings: embed * sqrt(hidden), and the per-layer table's
* sqrt(P)). The table may live in another device's memory than the rows it feeds (Gemma 4's
per-layer table in host memory, load_model(ple_on_cpu=True)): the ids go to the table, the
gathered rows come back to `device`. The step program's "scaled_token" feedback and its
prompt prefill use it."""
from __future__ import annotations

import torch


def scale_tensor(table: torch.Tensor, scale: float) -> torch.Tensor:
    """The scale as a 0-d tensor in the table's dtype, on its device (made once: inside a
    CUDA graph no host value may be copied over)."""
    return torch.tensor(scale, dtype=table.dtype, device=table.device)


def scaled_embedding(table: torch.Tensor, ids: torch.Tensor, scale,
                     device=None) -> torch.Tensor:
    """ids [n] -> [n, width] on `device` (default: the ids'); scale: a float or
    scale_tensor's."""
    s = scale if isinstance(scale, torch.Tensor) else scale_tensor(table, scale)
    rows = table[ids.to(table.device)] * s
    return rows.to(ids.device if device is None else device, non_blocking=True)
