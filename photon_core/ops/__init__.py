"""The ops the decode-step programs are made of, one op per file, each with its torch
reference (what the eager backend runs) and its Triton kernel (what the fused backend runs)
side by side; test/core/test_fast_kernels.py (and a test file per newer op, e.g.
test_row_stop.py, test_row_setup.py) diff-tests every kernel against its reference
(CPU, TRITON_INTERPRET=1).

gemv.py (linear: weight GEMV / skinny GEMM, b <= 16, with store / [x | gelu] / residual-add
epilogues), layernorm.py (LayerNorm and RMSNorm rows), rope.py (partial rotary tables),
decode_attention.py (decode attention over the prefix + causal text, with the rotary and the
k/v write; the prompt's causal attention), feedback_embedding.py (Moondream's GPU-resident
feedback: token / coordinate / size embedding by phase), row_advance.py (end of a step:
hidden, position, phase by the skill's phase table), masked_argmax.py (greedy picks with the
answer-marker rule, segments), seeded_sample.py (sampling inside a graph), row_stop.py (rows
whose lm pick is their task's stop token, marked on the GPU), row_setup.py (a row's fields for
a new task in one launch).

HAVE_TRITON is False when triton is not importable: the kernels cannot run and the runtime
uses the eager backend.
"""
from __future__ import annotations

import os

from ._triton import HAVE_TRITON

GEMV_MAX_ROWS = 16      # rows (batch rows or prompt tokens) one GEMV call takes (gemv.py)


def triton_on(t) -> bool:
    """Triton kernels run on CUDA tensors (or anywhere under TRITON_INTERPRET=1, as in CI)."""
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


__all__ = ["GEMV_MAX_ROWS", "HAVE_TRITON", "triton_on"]
