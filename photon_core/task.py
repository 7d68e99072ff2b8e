"""What a caller asks the engine to do, and what comes back.

These plain dataclasses are the contract between the ROS adapter (photon_ros), the
scheduler and the model engines. Nothing here imports torch or ROS.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# -- the limits: one set, shared by the CLI, the engines, the ROS node and replay ----------------
# (photon_ros.task_config imports these; the node's parameters default to them.)
DEFAULT_MAX_OBJECTS = 20        # detect/point: objects per request unless asked otherwise
DEFAULT_MAX_TOKENS = 64         # query/caption: decode steps unless asked otherwise
MAX_OBJECTS_LIMIT = 256         # the most a request may ask for (3 decode steps per box)
MAX_TOKENS_LIMIT = 1024         # the most a request may ask for (context is 2048 tokens)
MAX_QUESTION_CHARS = 1024       # query text; node parameter max_question_chars may lower it
MAX_OBJECT_CHARS = 256          # detect/point object name
MAX_TEMPERATURE = 10.0

SKILLS = ("detect", "point", "query", "caption")
CAPTION_LENGTHS = ("short", "normal", "long")

# Why a task stopped producing output.
FINISH_STOP = "stop"            # the model ended (eos, or no more objects)
FINISH_LENGTH = "length"        # max_tokens / max_objects reached
FINISH_CANCELLED = "cancelled"  # cancelled by the caller
FINISH_DEADLINE = "deadline"    # cancelled because its deadline passed
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_DEADLINE)


MAX_MESSAGE_CHARS = 600


def cut_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message of at most `limit` characters (its middle cut out): errors quote
    what the caller sent, which may be megabytes."""
    message = str(message)
    if len(message) <= limit:
        return message
    half = (limit - 5) // 2
    return f"{message[:half]} ... {message[-half:]}"


class TaskError(ValueError):
    """A task that cannot be run as given (unknown skill, empty question, ...)."""

    def __init__(self, message: str):
        super().__init__(cut_message(message))


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
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_objects: int = DEFAULT_MAX_OBJECTS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None         # sampling: same seed, same tokens (per path: CPU vs GPU differ;
                                    # GPU bf16/fp16: with deterministic=True, kernels/seeded_sample.py)

    def validate(self, max_question_chars: int = MAX_QUESTION_CHARS) -> "Task":
        """Check every field against the shared limits; TaskError says which and why."""
        if not isinstance(self.skill, str) or self.skill not in SKILLS:
            raise TaskError(f"unknown skill {self.skill!r}; expected one of {', '.join(SKILLS)}")
        for name in ("object", "question", "caption_length"):
            if not isinstance(getattr(self, name), str):
                raise TaskError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.skill in ("detect", "point"):
            if not self.object.strip():
                raise TaskError(f"{self.skill} needs a non-empty object name")
            if len(self.object) > MAX_OBJECT_CHARS:
                raise TaskError(f"object name is {len(self.object)} characters; the limit is "
                                f"{MAX_OBJECT_CHARS}")
        if self.skill == "query":
            if not self.question.strip():
                raise TaskError("query needs a non-empty question")
            limit = min(max_question_chars, MAX_QUESTION_CHARS)
            if len(self.question) > limit:
                raise TaskError(
                    f"question is {len(self.question)} characters; the limit is {limit}")
        if self.skill == "caption" and self.caption_length not in CAPTION_LENGTHS:
            raise TaskError(f"unknown caption length {self.caption_length!r}; expected one of "
                            f"{', '.join(CAPTION_LENGTHS)}")
        for name, hi in (("max_tokens", MAX_TOKENS_LIMIT), ("max_objects", MAX_OBJECTS_LIMIT)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TaskError(f"{name} must be an integer, got {v!r}")
            if not 1 <= v <= hi:
                raise TaskError(f"{name} must be in 1..{hi}, got {v}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TaskError(f"{name} must be a finite number, got {v!r}")
        if not (0 <= self.temperature <= MAX_TEMPERATURE) or not (0 < self.top_p <= 1):
            raise TaskError(f"temperature must be in 0..{MAX_TEMPERATURE:g} and top_p in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise TaskError(f"seed must be an integer in 0..2**63-1 or None, got {self.seed!r}")
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


def clip01(v: float) -> float:
    """A coordinate inside the 0..1 contract (NaN -> 0)."""
    v = float(v)
    return 0.0 if not v > 0.0 else (1.0 if v > 1.0 else v)


def clamp_objects(objects: list[dict]) -> list[dict]:
    """The coordinate contract: every x/y (boxes and points) is a fraction of the image in
    0..1. A box whose centre +- half its size reaches past an edge is cut at that edge (the
    model's size head can say "wider than the rest of the image"), as everywhere downstream
    (result messages, annotation, diff) expects."""
    return [{k: clip01(v) for k, v in o.items()} for o in objects]


def build_result(task: Task, objects: list[dict], text: str, finish_reason: str, steps: int,
                 timings: dict[str, float]) -> TaskResult:
    """The standard output dict of a finished run (objects for detect/point, text for
    query/caption), coordinates clamped to 0..1 (clamp_objects); engine_ms = encode +
    prefill + decode. Shared by every engine."""
    key = OUTPUT_KEYS[task.skill]
    output = {key: clamp_objects(objects) if task.skill in ("detect", "point") else text}
    return TaskResult(task=task, output=output, finish_reason=finish_reason, tokens=steps,
                      timings=dict(timings),
                      engine_ms=timings["encode_ms"] + timings["prefill_ms"] + timings["decode_ms"])
