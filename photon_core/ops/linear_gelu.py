"""gelu_tanh(x W^T + b) as one GEMM with a GELU epilogue (the big-M form: vision MLPs, the
image-prefix prefill; decode uses gemv.py's [x | gelu] epilogue).

Reference: F.gelu(F.linear(x, W, b), approximate="tanh") - the GEMM's output is rounded to
x's dtype, then GELU runs (in fp32 inside) and rounds again.
CUDA: torch._addmm_activation(b, x, W^T, use_gelu=True), which is cuBLASLt's GELU_BIAS
epilogue (the tanh approximation; PyTorch's non-Lt fallback also applies gelu "tanh"):
bias and GELU applied to the fp32 accumulator, rounded once, and no second pass over the
[M, ff] intermediate (the vision tower's GELU kernels were 0.9 ms of a 640x480 encode on
the H200, docs/benchmarks.md). Close to the reference (one rounding less), not bitwise.
Elsewhere (the CPU) the reference runs: the CPU _addmm_activation applies the exact erf GELU,
not the tanh one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_gelu_reference(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                fused: bool | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] -> gelu_tanh(x W^T + b) [..., N]. fused: None =
    the epilogue form on CUDA with a bias, else the reference."""
    if fused is None:
        fused = x.is_cuda and bias is not None
    if not fused:
        return linear_gelu_reference(x, weight, bias)
    if not x.is_cuda:
        raise ValueError("the fused GELU epilogue is CUDA only (the CPU's is the erf GELU)")
    lead = x.shape[:-1]
    y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return y.view(*lead, weight.shape[0])


__all__ = ["linear_gelu", "linear_gelu_reference"]
