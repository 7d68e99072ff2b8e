"""Word-safe text deltas: shared by every family and the runtime (photon_core/streaming.py)."""
from ...streaming import TextStreamer  # noqa: F401

__all__ = ["TextStreamer"]
