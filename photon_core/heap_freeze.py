"""The loaded process's objects kept out of Python's full garbage collections.

A process that has loaded torch, a model and its tokenizer tracks ~220,000 objects; a full
(generation 2) collection walks all of them: 166 ms on the H200 machine's host with
Moondream 2 loaded (bench/probe_gc.py, docs/benchmarks.md session 32), longer than a 100 ms
frame deadline, at a moment Python picks. After loading, `freeze_heap()` collects once and
moves every object alive into the permanent generation (gc.freeze): later collections walk
only what was allocated since (the same probe: a full collection 0.01 ms). Reference
cycles among frozen objects are never collected while frozen: `thaw_heap()` before freeing
a model (the node's deactivate) gives them back to the collector.

The freeze is process-wide, so the application decides (the ROS node does it once its
model is loaded and warm); the engine itself never touches the collector.
"""
from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze every object alive; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> int:
    """Give the frozen objects back to the collector (before freeing what they hold);
    returns how many were frozen."""
    n = gc.get_freeze_count()
    gc.unfreeze()
    return n
