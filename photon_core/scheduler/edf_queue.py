"""The queue of requests not yet started, in the order the scheduler considers them.

EDF: on-demand requests first; periodic ones by their stream's recent service (fewest frames
served first, fairness.py), then earliest deadline; ties (deadlines in the same
`FairShare.tie_s` bucket: frames of several cameras stamped at one tick, or the tasks of one
frame) go to the stream served least recently, then to its (stream, task) key served least
recently, so overloaded streams and an overloaded stream's tasks take turns (see
fairness.py). FIFO (the baseline): arrival order.
"""
from __future__ import annotations

from .fairness import FairShare
from .request import ON_DEMAND, TaskRequest

EDF = "edf"
FIFO = "fifo"


class RequestQueue:
    def __init__(self, order: str = EDF, fair: FairShare | None = None):
        if order not in (EDF, FIFO):
            raise ValueError(f"order must be {EDF!r} or {FIFO!r}")
        self.order = order
        self.fair = fair if fair is not None else FairShare(tie_s=0.0, gather_s=0.0, halflife_s=0.0)
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

    def sort_key(self, r: TaskRequest, now: float = float("-inf")):
        if self.order == FIFO:
            return (r.seq,)
        f = self.fair
        fr = r.frame
        # a frame already being served rides: its other tasks rank as before its credit
        share = f.share_class(r.stream, now, fr.started / max(1, fr.tasks)) \
            if r.kind != ON_DEMAND else 0
        return (r.kind != ON_DEMAND, share, f.bucket(r.deadline), f.served(r.stream),
                self.last_started.get(r.key, float("-inf")), r.seq)

    def ordered(self, now: float = float("-inf")) -> list[TaskRequest]:
        """Queue order at clock time `now` (fairness credit counts up to it)."""
        return sorted(self._items.values(), key=lambda r: self.sort_key(r, now))

    def note_started(self, req: TaskRequest, now: float) -> float:
        """req started at `now`; returns the frames of service it counts for its stream."""
        self.last_started[req.key] = now
        fr = req.frame
        if req.kind == ON_DEMAND:
            self.fair.note_started(req.stream, now, 0.0)
            return 0.0
        # the unit is frames served: each started task adds its share of its frame, 1 / (the
        # frame's tasks that could meet their deadline on arrival); at most 1 per frame
        share = 1.0 / max(1, fr.tasks)
        credit = max(0.0, min(share, 1.0 - fr.started * share))
        self.fair.note_started(req.stream, now, credit)
        fr.started += 1
        return credit
