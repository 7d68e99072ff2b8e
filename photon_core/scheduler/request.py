"""Requests and outcomes: what the scheduler is asked to do and what it reports.

A *frame* is one camera image (stream + stamp); the tasks asked on it share one encoded
image. A *task request* is one task on one frame, with an absolute deadline on the
scheduler's clock. Every task request ends in exactly one `Outcome`.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from photon_core.task import Task, TaskResult

PERIODIC = "periodic"        # camera-rate work: latest frame wins, may be preempted
ON_DEMAND = "on_demand"      # a one-off question: never superseded, preempts periodic work
KINDS = (PERIODIC, ON_DEMAND)

ON_MISS_FINISH = "finish"    # a started task past its deadline runs to the end (late result)
ON_MISS_CANCEL = "cancel"    # ... or is cancelled at the deadline (status DEADLINE)
ON_MISS = (ON_MISS_FINISH, ON_MISS_CANCEL)


class Status(str, enum.Enum):
    DONE = "done"                # result published (possibly late: see Outcome.missed_deadline)
    SKIPPED = "skipped"          # admission control: could not meet its deadline, never started
    SUPERSEDED = "superseded"    # a newer frame of the same (stream, task) replaced it
    CANCELLED = "cancelled"      # cancelled by the caller or by stop()
    DEADLINE = "deadline"        # started, then cancelled at its deadline (on_miss="cancel")
    ERROR = "error"              # the engine raised; see Outcome.error

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TaskSpec:
    """One task to run on a frame: a name (the key for latest-frame-wins and metrics), the
    Task, a relative deadline (seconds after the frame's capture time) and what to do when
    a started run passes its deadline."""

    name: str
    task: Task
    deadline_s: float
    on_miss: str = ON_MISS_CANCEL

    def __post_init__(self):
        if self.on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")
        if not self.deadline_s > 0:
            raise ValueError("deadline_s must be > 0")

    @classmethod
    def of(cls, x: "TaskSpec | tuple") -> "TaskSpec":
        """Accepts a TaskSpec or a tuple (name, Task, deadline_s[, on_miss])."""
        return x if isinstance(x, TaskSpec) else cls(*x)


@dataclass(eq=False)
class Frame:
    """One image of one stream; its tasks share the encoding (done once, freed when the
    last task referring to it ends)."""

    stream: str
    stamp: Any                   # totally ordered within a stream (e.g. float seconds)
    image: Any
    capture_time: float          # on the scheduler clock
    enc: Any = None
    encode_ms: float = 0.0
    refs: int = 0                # task requests not yet ended that use this frame
    tasks: int = 0               # its periodic task requests that could meet their deadline
                                 # on arrival (fairness: each started one is 1/tasks of a frame)
    started: int = 0             # its periodic task requests started so far
    adaptive: bool = False       # submitted as AdaptiveCrops: its crop mode is the ladder's

    @property
    def encoded(self) -> bool:
        return self.enc is not None


_ids = itertools.count(1)


@dataclass(eq=False)
class TaskRequest:
    frame: Frame
    spec: TaskSpec
    kind: str
    submit_time: float
    on_result: Callable[["Outcome"], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    seq: int = 0                 # arrival order inside one scheduler
    # set while it runs
    run: Any = None
    start_time: float | None = None
    steps: int = 0
    engine_ms: float = 0.0       # prefill + decode steps it took part in
    prefill_ms: float = 0.0
    preempted_steps: int = 0
    start_failures: int = 0      # engine.start / encode raised while other runs were open
    ended: bool = False
    probe: bool = False          # started although the cost model called it hopeless (a task probe)
    admissible: bool = True      # on arrival, admission would start it on an idle engine (Scheduler._admissible)

    @property
    def stream(self) -> str:
        return self.frame.stream

    @property
    def key(self) -> tuple[str, str]:
        return (self.frame.stream, self.spec.name)

    @property
    def deadline(self) -> float:
        return self.frame.capture_time + self.spec.deadline_s

    @property
    def started(self) -> bool:
        return self.run is not None


@dataclass
class Outcome:
    """How one task request ended. Times are on the scheduler clock (seconds)."""

    request_id: int
    stream: str
    stamp: Any
    task_name: str
    kind: str
    status: Status
    result: TaskResult | None = None
    error: str = ""
    capture_time: float = 0.0
    submit_time: float = 0.0
    start_time: float | None = None
    end_time: float = 0.0
    deadline: float = 0.0
    queue_ms: float = 0.0        # submit -> start (or -> end if never started)
    engine_ms: float = 0.0       # prefill + decode steps (encode in timings)
    timings: dict[str, float] = field(default_factory=dict)  # encode_ms, prefill_ms, ...
    steps: int = 0
    missed_deadline: bool = False   # DONE after the deadline, or DEADLINE
    probe: bool = False          # a task probe: started to re-measure costs (scheduler.py)

    @property
    def age_s(self) -> float:
        """Frame age when this outcome was delivered."""
        return self.end_time - self.capture_time

    @property
    def ok(self) -> bool:
        return self.status is Status.DONE
