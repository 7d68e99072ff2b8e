"""The engine contract as the scheduler uses it (photon_core.engine: Engine, Run, PrefixState).
The families' reference engines, the runtime's FastEngine, photon_ros' HookedEngine and the
simulator's SimEngine all implement it; nothing here guesses an engine's methods."""
from __future__ import annotations

from typing import Any, Sequence

from photon_core.engine import Engine, Run
from photon_core.task import Task

# the names the scheduler has always used
EngineLike = Engine
TaskRunLike = Run


def step_batch(engine: Engine, runs: Sequence[Run]) -> list[bool]:
    """One decode step for every run; returns, per run, whether it is still going."""
    out = [bool(x) for x in engine.step_batch(list(runs))]
    if len(out) != len(runs):
        raise RuntimeError(f"step_batch returned {len(out)} flags for {len(runs)} runs")
    return out


def count_prompt_tokens(engine: Engine, task: Task) -> int:
    """Prompt tokens a task prefills (after the image prefix), by the engine's own count."""
    return int(engine.count_prompt_tokens(task))


def encoded_crops(enc: Any) -> int | None:
    """Image units (crops) an encoded image was made of (PrefixState.n_crops)."""
    n = enc.n_crops
    return None if n is None else int(n)


def engine_capacity(engine: Engine) -> int | None:
    """Most runs the engine can hold open at once (Engine.max_runs; None: no limit)."""
    v = engine.max_runs
    return v if isinstance(v, int) and v > 0 else None
