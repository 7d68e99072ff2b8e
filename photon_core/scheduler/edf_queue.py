"""The queue of requests not yet started, in the order the scheduler considers them.

EDF: on-demand requests first, then earliest deadline; ties (the frames of one stream share
a deadline) go to the task served least recently, so an overloaded stream's tasks take
turns. FIFO (the baseline): arrival order.
"""
from __future__ import annotations

from .request import ON_DEMAND, TaskRequest

EDF = "edf"
FIFO = "fifo"


class RequestQueue:
    def __init__(self, order: str = EDF):
        if order not in (EDF, FIFO):
            raise ValueError(f"order must be {EDF!r} or {FIFO!r}")
        self.order = order
        self._items: dict[int, TaskRequest] = {}
        self.last_started: dict[tuple, float] = {}    # key -> clock time it last started

    def add(self, req: TaskRequest) -> None:
        self._items[req.id] = req

    def remove(self, req: TaskRequest) -> None:
        self._items.pop(req.id, None)

    def __contains__(self, req: TaskRequest) -> bool:
        return req.id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))

    def sort_key(self, r: TaskRequest):
        if self.order == FIFO:
            return (r.seq,)
        return (r.kind != ON_DEMAND, r.deadline, self.last_started.get(r.key, float("-inf")), r.seq)

    def ordered(self) -> list[TaskRequest]:
        return sorted(self._items.values(), key=self.sort_key)

    def note_started(self, req: TaskRequest, now: float) -> None:
        self.last_started[req.key] = now
