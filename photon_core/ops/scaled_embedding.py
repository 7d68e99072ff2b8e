"""Scaled token embedding: table[id] * scale, the scale rounded to the table's dtype first (as
transformers' Gemma scaled embeddings: embed * sqrt(hidden), and the per-layer table's
* sqrt(P)). The table may live in another device's memory than the rows it feeds (Gemma 4's
per-layer table in host memory, load_model(ple_on_cpu=True)): the ids go to the table, the
gathered rows come back to `device`. The step program's "scaled_token" feedback and its
prompt prefill use it."""
from __future__ import annotations

import torch


def scaled_embedding(table: torch.Tensor, ids: torch.Tensor, scale: float,
                     device=None) -> torch.Tensor:
    """ids [n] -> [n, width] on `device` (default: the ids')."""
    s = torch.tensor(scale, dtype=table.dtype, device=table.device)
    rows = table[ids.to(table.device)] * s
    return rows.to(ids.device if device is None else device, non_blocking=True)
