"""The engine protocol the scheduler drives. The Moondream reference engine, the GPU fast
path and the simulator's SimEngine all fit it."""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from photon_core.task import Task, TaskResult


@runtime_checkable
class TaskRunLike(Protocol):
    def step(self) -> bool:
        """One decode step; False once finished."""

    def cancel(self, reason: str) -> None:
        """Stop; result() then carries finish_reason `reason` ("cancelled" / "deadline")."""

    def result(self) -> TaskResult: ...


@runtime_checkable
class EngineLike(Protocol):
    def encode_image(self, image: Any) -> Any:
        """-> EncodedImage, shareable by every task started on it."""

    def start(self, enc: Any, task: Task) -> TaskRunLike:
        """Prefill the task prompt after the shared image prefix."""

    # Optional: def step_batch(self, runs) -> list[bool]   (one decode step for all runs)


def _finished(run: Any) -> bool:
    for attr in ("finished", "done", "is_finished"):
        v = getattr(run, attr, None)
        if v is not None:
            return bool(v() if callable(v) else v)
    raise TypeError("engine.step_batch returned None and the run has no finished/done flag")


def step_batch(engine: Any, runs: Sequence[TaskRunLike]) -> list[bool]:
    """One decode step for every run; returns, per run, whether it is still going.

    Uses engine.step_batch when the engine has it (it may return a list of bools, or None
    with runs exposing `finished`/`done`), else steps the runs one by one."""
    fn = getattr(engine, "step_batch", None)
    if fn is None:
        return [bool(r.step()) for r in runs]
    out = fn(list(runs))
    if out is None:
        return [not _finished(r) for r in runs]
    out = [bool(x) for x in out]
    if len(out) != len(runs):
        raise RuntimeError(f"step_batch returned {len(out)} flags for {len(runs)} runs")
    return out


def count_prompt_tokens(engine: Any, task: Task) -> int:
    """Prompt tokens a task prefills (after the image prefix). Uses the engine's own count
    when it offers one, else a rough estimate (the cost model only needs the scale)."""
    fn = getattr(engine, "count_prompt_tokens", None)
    if fn is None:                        # the Moondream engines: the tokenizer builds the prompt
        prompt = getattr(getattr(engine, "tokenizer", None), "prompt", None)
        if prompt is not None:
            fn = lambda t: len(prompt(t.skill, t.target))  # noqa: E731
    if fn is not None:
        try:
            return int(fn(task))
        except Exception:  # noqa: BLE001 - an estimate is fine here
            pass
    text = task.target if task.skill != "caption" else ""
    return 8 + (len(text) + 3) // 4


def encoded_crops(enc: Any) -> int | None:
    """Crops an EncodedImage was made of, when it says (n_crops, or tiling + 1 global)."""
    n = getattr(enc, "n_crops", None)
    if n is not None:
        return int(n)
    tiling = getattr(enc, "tiling", None)
    if tiling is not None and len(tiling) == 2:
        return 1 + int(tiling[0]) * int(tiling[1])
    return None


def engine_capacity(engine: Any) -> int | None:
    """Most runs the engine can hold open at once, when it says: `max_runs` / `max_batch`
    (int), or the fast path's row table. None: unlimited as far as we know."""
    for attr in ("max_runs", "max_batch"):
        v = getattr(engine, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    owner = getattr(getattr(engine, "rows", None), "owner", None)
    if isinstance(owner, list) and owner:
        return len(owner)
    return None
