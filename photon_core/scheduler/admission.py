"""Admission control: start a request only if the cost model says it, and everything
already running, will still finish before their deadlines.

The projection is a small event simulation of the decode batches to come: runs are ranked
(on-demand first, then earliest deadline), the best `max_batch` step together, a step of b
runs costs step_ms(b), and a run leaves the batch after its estimated remaining steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Load:
    remaining: float         # decode steps still expected
    deadline: float          # absolute, seconds
    rank: tuple              # smaller steps first when the batch is full
    check: bool = True       # False: already late / not ours to protect
    margin: float = 0.0      # seconds it should finish ahead of its deadline


def project(t0: float, loads: list[Load], max_batch: int,
            step_ms: Callable[[int], float]) -> list[float]:
    """Projected finish time (seconds) of each load, decoding from t0."""
    rem = [max(0.0, l.remaining) for l in loads]
    fin = [t0] * len(loads)
    active = sorted((i for i in range(len(loads)) if rem[i] > 0), key=lambda i: loads[i].rank)
    t = t0
    while active:
        batch = active[:max_batch]
        n = min(rem[i] for i in batch)
        t += n * step_ms(len(batch)) / 1e3
        for i in batch:
            rem[i] -= n
            if rem[i] <= 1e-9:
                fin[i] = t
        active = [i for i in active if rem[i] > 1e-9]
    return fin


def fits(now: float, start_ms: float, candidate: Load, live: list[Load], max_batch: int,
         step_ms: Callable[[int], float], margin_s: float = 0.0) -> bool:
    """Would starting `candidate` now (start_ms of encode + prefill, during which nothing
    decodes) keep the candidate and every checked live run within its deadline?"""
    loads = live + [candidate]
    fin = project(now + start_ms / 1e3, loads, max_batch, step_ms)
    return all(f + margin_s + l.margin <= l.deadline for f, l in zip(fin, loads) if l.check)


def hopeless(now: float, start_ms: float, steps: float, deadline: float,
             step_ms: Callable[[int], float]) -> bool:
    """Even started now and decoding alone it would miss its deadline."""
    return now + (start_ms + steps * step_ms(1)) / 1e3 > deadline
