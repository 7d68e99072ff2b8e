"""Latest frame wins, per (stream, task name).

At most one request per key waits to start; a newer frame's request replaces it (the old
one is SUPERSEDED). A request whose frame is not newer than one already waiting or already
published for its key is superseded on arrival. When a result is published, older frames
of the key still running are superseded too, so results of one key only move forward.
"""
from __future__ import annotations

from .request import TaskRequest


class LatestFrameTable:
    def __init__(self):
        self.pending: dict[tuple, TaskRequest] = {}
        self.published: dict[tuple, object] = {}     # key -> newest stamp published

    def offer(self, req: TaskRequest) -> list[TaskRequest]:
        """Register a new periodic request; returns the requests it makes superseded (the
        previous waiting one, or `req` itself when it is not newer)."""
        key, stamp = req.key, req.frame.stamp
        pub = self.published.get(key)
        if pub is not None and not stamp > pub:
            return [req]
        old = self.pending.get(key)
        if old is not None and not stamp > old.frame.stamp:
            return [req]
        self.pending[key] = req
        return [old] if old is not None else []

    def take(self, req: TaskRequest) -> None:
        """`req` starts or ends: it no longer waits."""
        if self.pending.get(req.key) is req:
            del self.pending[req.key]

    def is_stale(self, req: TaskRequest) -> bool:
        """A newer (or the same) frame of this key was already published."""
        pub = self.published.get(req.key)
        return pub is not None and not req.frame.stamp > pub

    def publish(self, req: TaskRequest) -> None:
        pub = self.published.get(req.key)
        if pub is None or req.frame.stamp > pub:
            self.published[req.key] = req.frame.stamp
