"""Clocks: the scheduler reads time only through one of these, so the simulator's virtual
clock and the wall clock drive the same code."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds, monotonic."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Time moves only when told to (the simulator's SimEngine advances it by the cost of
    the work it pretends to do)."""

    def __init__(self, t0: float = 0.0):
        self.t = float(t0)

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time does not go back")
        self.t += dt

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, float(t))
