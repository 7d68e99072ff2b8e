"""Moondream 2's skill protocol, in one place: the phases of a task, which heads a step of
each phase samples with, what the sampled value feeds back, which phase follows, and how
the values of a finished object become a result. The reference path (run.py), the runtime's
host side (photon_core/fast/fast_run.py) and its GPU side (the phase table read by the step's
row advance, the feedback by phase) all use these tables.

query / caption: phase text: the lm head picks a token (the answer marker is never picked
  again after the first pick), the token's embedding feeds back; ends at eos / max_tokens.
detect: per object x -> y -> size: x: the lm head says eos (no more objects) or goes on, and
  the coord head gives x; y: the coord head gives y; size: the size head gives (w, h); each
  value feeds back through its encoder. Box = (x -+ w/2, y -+ h/2). point: x -> y, no size.
"""
from __future__ import annotations

PHASE_TEXT, PHASE_X, PHASE_Y, PHASE_SIZE = 0, 1, 2, 3
# columns of a step's sampled values `out` [rows, 4]
OUT_TOKEN, OUT_COORD, OUT_W, OUT_H = 0, 1, 2, 3
# the row kind selects a column of NEXT_PHASE: 0 text / point, 1 detect
KIND_DETECT = 1
# phase after a step of phase p, for a row of kind k: NEXT_PHASE[p][k]
NEXT_PHASE = ((PHASE_TEXT, PHASE_TEXT),
              (PHASE_Y, PHASE_Y),
              (PHASE_X, PHASE_SIZE),
              (PHASE_X, PHASE_X))
# the heads a step of each phase samples with ("lm": the lm head's token - text: the next
# token; x: eos or go on - "coord", "size": the region heads)
HEADS = {PHASE_TEXT: ("lm",), PHASE_X: ("lm", "coord"), PHASE_Y: ("coord",),
         PHASE_SIZE: ("size",)}
# the value a step of each phase feeds back (ops/feedback_embedding.py picks it by phase)
FEEDBACK = {PHASE_TEXT: "token", PHASE_X: "coord", PHASE_Y: "coord", PHASE_SIZE: "size"}
TEXT_SKILLS = ("query", "caption")
STEPS_PER_OBJECT = {"detect": 3, "point": 2}


def is_text(skill: str) -> bool:
    return skill in TEXT_SKILLS


def first_phase(skill: str) -> int:
    return PHASE_TEXT if is_text(skill) else PHASE_X


def row_kind(skill: str) -> int:
    return KIND_DETECT if skill == "detect" else 0


def next_phase(phase: int, kind: int) -> int:
    return NEXT_PHASE[phase][kind]


def step_budget(task) -> int:
    """Decode steps a task may take: max_tokens, or per object its phases."""
    return task.max_tokens if is_text(task.skill) else \
        STEPS_PER_OBJECT[task.skill] * task.max_objects


def ends_object(phase: int, kind: int) -> bool:
    """A step of this phase completes an object (point: y; detect: size)."""
    return next_phase(phase, kind) == PHASE_X and phase != PHASE_X


class RegionCollector:
    """The values of a detect / point task's steps -> its objects (normalized 0..1)."""

    def __init__(self, skill: str):
        self.kind = row_kind(skill)
        self.pending: dict[int, float] = {}
        self.objects: list[dict] = []

    def take(self, phase: int, value) -> None:
        """value: a coordinate (x, y phases) or (width, height) (size phase)."""
        if phase == PHASE_SIZE:
            bw, bh = value
            x, y = self.pending[PHASE_X], self.pending[PHASE_Y]
            self.objects.append({"x_min": x - bw / 2, "y_min": y - bh / 2,
                                 "x_max": x + bw / 2, "y_max": y + bh / 2})
            return
        self.pending[phase] = value
        if ends_object(phase, self.kind):
            self.objects.append({"x": self.pending[PHASE_X], "y": self.pending[PHASE_Y]})
