"""Moondream 2's partial rotary embedding (Phi style): photon_core/ops/rope.py (the op's
reference; its docstring explains the interleaved channel order)."""
from ...ops.rope import apply_rope, rope_angles

__all__ = ["apply_rope", "rope_angles"]
