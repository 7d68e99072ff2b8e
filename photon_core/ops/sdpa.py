"""Scaled-dot-product attention without a mask, graph-capture friendly.

Reference: F.scaled_dot_product_attention(q, k, v, scale=scale) - what this returns everywhere.
Where torch would run its cuDNN kernel and a CUDA-graph capture collects droppable fills
(graph_fills.collecting()), the same cuDNN op is called directly
(aten._scaled_dot_product_cudnn_attention, the arguments F.scaled_dot_product_attention
passes it at inference: no log-sum-exp, dropout 0, not causal): the same kernel and bits,
and the op's dropout seed / offset tensors - zero-filled, never read at dropout 0 - are
reported, so the capture drops their two memset nodes (photon_core/graph_fills.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import graph_fills


def _cudnn_chosen(q, k, v, scale) -> bool:
    from torch.nn.attention import SDPBackend
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=scale)
    return int(choice) == int(SDPBackend.CUDNN_ATTENTION.value)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v over [n, heads, t, hd] (no mask, no dropout; enable_gqa: k / v
    heads shared by groups of q heads - always F.scaled_dot_product_attention's form)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if (q.is_cuda and graph_fills.collecting() and not grad and not enable_gqa
            and _cudnn_chosen(q, k, v, scale)):
        before = graph_fills.capture_tail()
        if before is not None:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, False, False, scale=scale)
            graph_fills.note_fills(before, out[6:8])
            return out[0]
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
