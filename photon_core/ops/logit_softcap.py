"""Final logit soft-capping: cap * tanh(logits / cap) (Gemma's final_logit_softcapping).

`logit_softcap` is the torch reference; `logit_softcap_triton(logits, cap, out=None)` its
Triton kernel over rows (fp32 math, in place when out is logits), diff-tested under
TRITON_INTERPRET=1. The fused backend runs it right after the lm head's GEMV, before the
argmax (softcapping is monotonic, so a greedy pick could skip it; sampling and recorded
logits need it).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .gated_activation import _tanh


def logit_softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


@triton.jit
def _softcap_kernel(x_ptr, o_ptr, n, stride_x, stride_o, cap, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + c, (_tanh(x / cap) * cap).to(o_ptr.dtype.element_ty),
             mask=m)


def logit_softcap_triton(logits: torch.Tensor, cap: float | None,
                         out: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """logits [rows, n] (unit column stride) -> out (default: in place)."""
    out = logits if out is None else out
    if cap is None:
        return out if out is logits else out.copy_(logits)
    assert logits.dim() == 2 and logits.stride(1) == 1 and out.stride(1) == 1
    rows, n = logits.shape
    block = min(block, triton.next_power_of_2(n))
    _softcap_kernel[(rows, triton.cdiv(n, block))](logits, out, n, logits.stride(0),
                                                  out.stride(0), float(cap), BLOCK=block)
    return out
