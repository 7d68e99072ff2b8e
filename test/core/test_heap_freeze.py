"""photon_core/heap_freeze.py: frozen objects are out of full collections until thawed,
and a reference cycle dropped while frozen is collected once thawed."""
from __future__ import annotations

import gc
import weakref

from photon_core.heap_freeze import freeze_heap, thaw_heap


class Node:
    pass


def test_freeze_keeps_cycles_until_thawed():
    a, b = Node(), Node()
    a.other, b.other = b, a                  # a reference cycle: only gc frees it
    ref = weakref.ref(a)
    try:
        n = freeze_heap()
        assert n == gc.get_freeze_count() and n > 1000
        del a, b
        gc.collect()
        assert ref() is not None             # frozen: the full collection skipped it
        assert thaw_heap() == n
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert ref() is None                 # thawed: collected
    finally:
        gc.unfreeze()
