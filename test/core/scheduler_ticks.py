"""Shared step of the scheduler tests on a virtual clock (test/core): serve one frame period."""
from __future__ import annotations


def step_until(s, clock, end: float) -> None:
    """Step scheduler s while it has work and the virtual clock is before `end`; a hold
    (fairness: work held until a time) is waited out by advancing the clock to its end, at
    most to `end`."""
    while s.has_work() and clock.now() < end:
        s.step()
        until = s.idle_until()
        if until is not None:
            clock.advance_to(min(until, end))
