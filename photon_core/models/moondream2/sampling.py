"""Moondream 2's sampling: greedy / temperature + top-p (the op: photon_core/ops/sampling.py)."""
from ...ops.sampling import sample, top_p_filter

__all__ = ["sample", "top_p_filter"]
