"""The engine contract as the scheduler uses it (photon_core.engine: Engine, Run, PrefixState).
The families' reference engines, the runtime's FastEngine, photon_ros' HookedEngine and the
simulator's SimEngine all implement it; nothing here guesses an engine's methods.
Optional, declared by the engine: encode_batch (encode_batch.py), queued_encode (encodes_queued),
crop_count (crop_counter)."""
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


def crop_counter(engine: Any):
    """The engine's `crop_count(height, width, crops)` (crops the encoder will run for a frame,
    by the family's own tiling rule: Moondream 2's reference and fast engines) where it has
    one, else None (the cost model then estimates, cost_model.moondream_crops)."""
    f = getattr(engine, "crop_count", None)
    return f if callable(f) else None


def engine_capacity(engine: Engine) -> int | None:
    """Most runs the engine can hold open at once (Engine.max_runs; None: no limit)."""
    v = engine.max_runs
    return v if isinstance(v, int) and v > 0 else None


def encodes_queued(engine: Any) -> bool:
    """The engine declares `queued_encode = True`: its encode_image(image, sync=False) and
    encode_batch(images, sync=False) (where it has one) may return once the encode is queued
    on the device, each encoding's `gpu_encode_ms()` then giving the encode's device time
    (waiting for it; PrefixState.gpu_timing). The scheduler then starts the frame's tasks
    before reading the encode's cost (their prefills queue behind the encode). An explicit
    flag, not a guess from signatures: a wrapper must forward it on purpose (only `True`
    counts, so a mock's auto-attribute does not)."""
    return getattr(engine, "queued_encode", False) is True
