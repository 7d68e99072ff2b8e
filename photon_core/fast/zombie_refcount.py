"""Batch-slot (row) ownership with refcounts: how zombies are released.

A row belongs to one run from start() on. Every launched step that includes the row holds a
reference until that step is committed. A run that finishes (eos, max_objects, cancel,
deadline) while a later step of it is already queued keeps riding along in that step as a
zombie: its results are discarded at commit, and the row returns to the free list only when
the run is finished AND no launched step refers to it any more (refcount 0). Batch
membership of a launched step never changes.
"""
from __future__ import annotations


class RowRefcount:
    def __init__(self, rows: int):
        self.owner: list = [None] * rows
        self.refs = [0] * rows
        self.released: list[int] = []     # rows freed so far (tests read the order)

    def free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o is None]

    def acquire(self, run) -> int | None:
        """Lowest free row (keeps the live rows dense, so batch buckets stay small)."""
        for r, o in enumerate(self.owner):
            if o is None:
                self.owner[r] = run
                return r
        return None

    def hold(self, row: int) -> None:
        self.refs[row] += 1

    def drop(self, row: int) -> None:
        self.refs[row] -= 1
        assert self.refs[row] >= 0, f"row {row} refcount below zero"
        self._maybe_release(row)

    def finished(self, row: int) -> None:
        """The owner finished; free the row now if no launched step refers to it."""
        self._maybe_release(row)

    def _maybe_release(self, row: int) -> None:
        o = self.owner[row]
        if o is not None and o.finished and self.refs[row] == 0:
            self.owner[row] = None
            self.released.append(row)
            o.row = None

    def live_rows(self) -> int:
        """1 + the highest row in use (the bucket must cover it)."""
        used = [r for r, o in enumerate(self.owner) if o is not None]
        return used[-1] + 1 if used else 0
