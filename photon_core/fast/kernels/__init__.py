"""Triton kernels of the fused decode step (photon_core/fast/fused_step.py), one mechanism
per file: gemv.py (bf16 weight GEMV / skinny GEMM at batch 1..8 with fused epilogues),
layernorm.py (row LayerNorm), decode_attention.py (partial rotary + KV-cache write +
split-sequence attention over each row's valid prefix, and the split combine).

HAVE_TRITON is False when triton is not importable; then nothing here can run and the fast
path uses its torch step. Tests run the kernels on the CPU with TRITON_INTERPRET=1.
"""
from __future__ import annotations

GEMV_MAX_ROWS = 16      # rows (batch rows or prompt tokens) one GEMV call takes (gemv.py)

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False
