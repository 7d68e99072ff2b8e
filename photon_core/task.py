"""What a caller asks the engine to do, and what comes back.

These plain dataclasses are the contract between the ROS adapter (photon_ros), the
scheduler and the model engines. Nothing here imports torch or ROS.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SKILLS = ("detect", "point", "query", "caption")
CAPTION_LENGTHS = ("short", "normal", "long")

# Why a task stopped producing output.
FINISH_STOP = "stop"            # the model ended (eos, or no more objects)
FINISH_LENGTH = "length"        # max_tokens / max_objects reached
FINISH_CANCELLED = "cancelled"  # cancelled by the caller
FINISH_DEADLINE = "deadline"    # cancelled because its deadline passed
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_DEADLINE)


class TaskError(ValueError):
    """A task that cannot be run as given (unknown skill, empty question, ...)."""


@dataclass(frozen=True)
class Task:
    """One skill to run on one image.

    `object` is the target of detect/point, `question` the text of query; caption uses
    `caption_length`. Sampling options apply to query/caption only: detect/point are greedy.
    """

    skill: str
    object: str = ""
    question: str = ""
    caption_length: str = "normal"
    max_tokens: int = 128
    max_objects: int = 50
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None         # sampling: same seed, same tokens (per path: CPU vs GPU differ;
                                    # GPU bf16/fp16: with deterministic=True, kernels/seeded_sample.py)

    def validate(self, max_question_chars: int = 4096) -> "Task":
        if self.skill not in SKILLS:
            raise TaskError(f"unknown skill {self.skill!r}; expected one of {', '.join(SKILLS)}")
        if self.skill in ("detect", "point") and not self.object.strip():
            raise TaskError(f"{self.skill} needs a non-empty object name")
        if self.skill == "query":
            if not self.question.strip():
                raise TaskError("query needs a non-empty question")
            if len(self.question) > max_question_chars:
                raise TaskError(
                    f"question is {len(self.question)} characters; the limit is {max_question_chars}")
        if self.skill == "caption" and self.caption_length not in CAPTION_LENGTHS:
            raise TaskError(f"unknown caption length {self.caption_length!r}; expected one of "
                            f"{', '.join(CAPTION_LENGTHS)}")
        if self.max_tokens < 1:
            raise TaskError("max_tokens must be >= 1")
        if self.max_objects < 1:
            raise TaskError("max_objects must be >= 1")
        if self.temperature < 0 or not (0 < self.top_p <= 1):
            raise TaskError("temperature must be >= 0 and top_p in (0, 1]")
        return self

    @property
    def target(self) -> str:
        """The object (detect/point), the question (query) or the caption length."""
        if self.skill in ("detect", "point"):
            return self.object
        if self.skill == "query":
            return self.question
        return self.caption_length


@dataclass
class TaskResult:
    """The outcome of one task on one image.

    `output` is the standard Moondream dict: {"objects": [{x_min, y_min, x_max, y_max}]},
    {"points": [{x, y}]}, {"answer": str} or {"caption": str}, coordinates normalized 0..1.
    """

    task: Task
    output: dict[str, Any]
    finish_reason: str = FINISH_STOP
    tokens: int = 0                 # decode steps spent
    engine_ms: float = 0.0          # time inside the engine for this task (encode share included)
    timings: dict[str, float] = field(default_factory=dict)  # e.g. encode_ms, prefill_ms, decode_ms


OUTPUT_KEYS = {"detect": "objects", "point": "points", "query": "answer", "caption": "caption"}


def build_result(task: Task, objects: list[dict], text: str, finish_reason: str, steps: int,
                 timings: dict[str, float]) -> TaskResult:
    """The standard output dict of a finished run (objects for detect/point, text for
    query/caption); engine_ms = encode + prefill + decode. Shared by every engine."""
    key = OUTPUT_KEYS[task.skill]
    output = {key: list(objects) if task.skill in ("detect", "point") else text}
    return TaskResult(task=task, output=output, finish_reason=finish_reason, tokens=steps,
                      timings=dict(timings),
                      engine_ms=timings["encode_ms"] + timings["prefill_ms"] + timings["decode_ms"])
