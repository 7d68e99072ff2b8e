"""Weights held side by side in one tensor: the fused backend joins the weights of a fused GEMV
(its rows, its K columns, or gate / up rows in pairs) and the model's own entries become views
of the joined tensor (fast/fused_backend.py, SHARE_WEIGHTS), so the model is held once.

  join_weights(tensors, how)     one contiguous tensor, the parts side by side
  joined_views(joined, shapes, how)  the parts as views of it
  adjacent_rows(tensors)         one view spanning weights that already lie in consecutive
                                 rows of one tensor (None otherwise): a reference op can then
                                 run one GEMM where it named several (Qwen 3.5's encode)
  hold(tensors) / held(tensors)  the tensors a built engine or a captured CUDA graph may read
                                 by address: a weight may be replaced by a view of a joined
                                 copy only while none of its tensors is held
"""
from __future__ import annotations

import weakref

import torch

from .ops.gemv import interleave_gated

# the weight tensors a StepState was built on or a CUDA graph captured with (weakly held: a
# freed model's entries go with it, so a new tensor at a reused address is never taken for
# an old one)
_HELD: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _tensors(ts) -> list:
    ts = ts.values() if isinstance(ts, dict) else ts
    return [t for t in ts if isinstance(t, torch.Tensor)]


def held(tensors) -> bool:
    """Some of these tensors (a list, or a dict's values) may be read by address already."""
    return any(_HELD.get(id(t)) is t for t in _tensors(tensors))


def hold(tensors) -> None:
    """Mark these tensors (a list, or a dict's values) as read by address from now on."""
    for t in _tensors(tensors):
        _HELD[id(t)] = t


def joined_views(joined: torch.Tensor, shapes: list, how: str) -> list[torch.Tensor]:
    """The parts of a joined weight as views of it: how "rows" (torch.cat), "cols"
    (torch.cat along K: strided views), "pairs" (interleave_gated of two: strided views)."""
    if how == "rows":
        return list(joined.split([s[0] for s in shapes]))
    if how == "cols":
        return list(joined.split([s[1] for s in shapes], dim=1))
    n = shapes[0][0]
    return list(joined.view(n, 2, *joined.shape[1:]).unbind(1))


def join_weights(tensors: list[torch.Tensor], how: str) -> torch.Tensor:
    """One contiguous tensor holding the weights side by side (joined_views' layouts)."""
    if how == "rows":
        return torch.cat(tensors).contiguous()
    if how == "cols":
        return torch.cat(tensors, dim=1).contiguous()
    return interleave_gated(*tensors).contiguous()


def adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """[N_i, K] contiguous weights that follow one another in one storage (each starting where
    the one before ends) -> the [sum N_i, K] view spanning them; None where they do not."""
    first = tensors[0]
    if first.dim() != 2:
        return None
    k, storage = first.shape[1], first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (t.dim() != 2 or t.shape[1] != k or not t.is_contiguous() or t.dtype != first.dtype
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), k), (k, 1))


__all__ = ["adjacent_rows", "hold", "held", "join_weights", "joined_views"]
