"""The live pipeline: model + calibration + deadline scheduler + per-camera frame sequencing,
built by one function for both the perception node and `photon replay --mode realtime`.

    live = build_live_pipeline(config)                         # node: loads the model, threaded
    live = build_live_pipeline(config, model, clock=c, threaded=False, on_result=cb)   # replay

`live.accept(camera, stamp_s)` numbers a camera's frames the way both tools do: a source
stamp that jumps back by more than JUMP_BACK_S (bag loop, camera restart) starts a new epoch
(index 0, cadence reset); a stamp not newer than the last one is a stale frame (dropped). It
returns the frame's index, its scheduler key (epoch, stamp) and the tasks due on it;
`live.submit(...)` hands those tasks to the scheduler. No rclpy import here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from photon_core.scheduler.crop_ladder import LADDER
from photon_ros.pipeline import JUMP_BACK_S, PerceptionPipeline
from photon_ros.task_config import ADAPTIVE, PerceptionConfig, TaskConfig

NEW, JUMP, STALE = "new", "jump", "stale"


@dataclass
class FrameTicket:
    """What `FrameSequencer.next` decided about one frame."""
    event: str                        # NEW | JUMP (new epoch) | STALE (drop it)
    index: int = -1                   # frame number within the epoch (0-based)
    key: tuple = ()                   # (epoch, stamp_s): the scheduler's frame identity
    jumped_s: float = 0.0             # JUMP: how far the stamp went back
    last_stamp_s: float | None = None
    due: list[TaskConfig] = field(default_factory=list)


class FrameSequencer:
    """Per-camera frame numbering by source stamps (thread-safe)."""

    def __init__(self, on_jump: Callable[[str], None] | None = None,
                 jump_back_s: float = JUMP_BACK_S):
        self.jump_back_s = jump_back_s
        self._on_jump = on_jump
        self._last: dict[str, float] = {}
        self._index: dict[str, int] = {}
        self._epoch: dict[str, int] = {}
        self._lock = threading.Lock()

    def reset(self, camera: str | None = None) -> None:
        with self._lock:
            for d in (self._last, self._index, self._epoch):
                if camera is None:
                    d.clear()
                else:
                    d.pop(camera, None)

    def next(self, camera: str, stamp_s: float) -> FrameTicket:
        with self._lock:
            last = self._last.get(camera)
            event = NEW
            if last is not None and stamp_s < last - self.jump_back_s:
                event = JUMP
                self._epoch[camera] = self._epoch.get(camera, 0) + 1
                self._index[camera] = 0
            elif last is not None and stamp_s <= last:
                return FrameTicket(STALE, last_stamp_s=last)
            self._last[camera] = stamp_s
            index = self._index.get(camera, 0)
            self._index[camera] = index + 1
            key = (self._epoch.get(camera, 0), stamp_s)
        if event == JUMP and self._on_jump is not None:
            self._on_jump(camera)
        return FrameTicket(event, index, key, jumped_s=(last - stamp_s) if event == JUMP else 0.0,
                           last_stamp_s=last)


class LivePipeline:
    """The pieces the node and realtime replay share. `scheduler` is a
    photon_core.scheduler.ThreadedScheduler (threaded=True) or a plain Scheduler the caller
    steps itself."""

    def __init__(self, pipeline: PerceptionPipeline, model: Any, engine: Any, cost: Any,
                 scheduler: Any):
        self.pipeline, self.model, self.engine, self.cost = pipeline, model, engine, cost
        self.scheduler = scheduler
        self.frames = FrameSequencer(on_jump=pipeline.cadence.reset)

    @property
    def config(self) -> PerceptionConfig:
        return self.pipeline.config

    def set_config(self, config: PerceptionConfig) -> None:
        self.pipeline.set_config(config)

    def accept(self, camera: str, stamp_s: float) -> FrameTicket:
        """Number this frame of `camera` and find its due tasks (none for a stale frame).
        Raises ValueError for a camera the configuration does not have."""
        ticket = self.frames.next(camera, stamp_s)
        if ticket.event != STALE:
            ticket.due = self.pipeline.due_tasks(camera, ticket.index, stamp_s)
        return ticket

    def submit(self, camera: str, ticket: FrameTicket, image, arrival: float,
               on_result: Callable | None = None) -> int:
        """Queue the due tasks of an accepted frame; returns how many."""
        from photon_core.scheduler import PERIODIC, TaskSpec

        specs = [TaskSpec(t.name, t.to_task(), t.deadline_ms / 1e3, t.on_miss) for t in ticket.due]
        if specs:
            self.scheduler.submit_frame(camera, ticket.key, self.encode_input(camera, image),
                                        specs, kind=PERIODIC, on_result=on_result,
                                        capture_time=arrival)
        return len(specs)

    def encode_input(self, camera: str, image):
        """The frame as the scheduler hands it to the engine: with the camera's crops mode
        (an EncodeRequest) where the family has crop modes (PerceptionPipeline.encode_input).
        On-demand requests on a camera's latest frame go through this too."""
        return self.pipeline.encode_input(camera, image, adaptive=True)

    def prepare(self) -> int:
        """Capture the encode graphs of every configured camera size and crop mode now
        (engines with prepare_encode: the fast path), not in live traffic; returns how many."""
        prepare = getattr(self.model, "prepare_encode", None)
        if prepare is None:
            return 0
        return prepare_encodes(prepare, self.config)

    def stop(self) -> None:
        """Stop the scheduler (threaded: open requests end as cancelled) and drop the model."""
        stop = getattr(self.scheduler, "stop", None)
        if stop is not None:
            stop(drain=False)
        self.scheduler = self.engine = self.model = None
        self.pipeline.model = None


def prepare_encodes(prepare: Callable, config: PerceptionConfig) -> int:
    """engine.prepare_encode for each configured camera size (<camera>.width/height) with its
    crops mode (an adaptive camera: each mode of the ladder): frames per batched encode 1, 2,
    4, 8 up to the cameras of that size and mode (and max_batch); returns the graphs
    captured."""
    groups: dict[tuple, int] = {}
    for c in config.cameras:
        if c.width and c.height:
            for mode in (LADDER if c.crops == ADAPTIVE else (c.crops,)):
                key = (mode, c.height, c.width)
                groups[key] = groups.get(key, 0) + 1
    n = 0
    for (mode, h, w), cams in sorted(groups.items()):
        most = max(1, min(cams, config.max_batch))
        sizes = tuple(b for b in (1, 2, 4, 8) if b <= most)
        n += int(prepare(shapes=((h, w),), batch_sizes=sizes, crops=(mode,)) or 0)
    return n


def load_model(config: PerceptionConfig, progress: bool = False):
    """config.model on config.device/dtype through photon_core.load_engine."""
    from photon_core import load_engine
    from photon_core.engine import EngineOptions

    return load_engine(config.model, device=config.device, dtype=config.dtype,
                       engine=config.engine, deterministic=config.deterministic,
                       max_batch=config.max_batch, progress=progress,
                       options=EngineOptions(megakernel=config.megakernel))


def build_live_pipeline(config: PerceptionConfig, model: Any = None, *, clock: Any = None,
                        threaded: bool = True, calibrate: bool = True,
                        on_result: Callable | None = None,
                        model_id: str | None = None) -> LivePipeline:
    """Load the model (unless given), wrap it for per-request hooks (HookedEngine, with the
    config's debug_* hooks), prepare the encode graphs of the configured camera sizes (engines
    with prepare_encode), calibrate the cost model on it (on `clock`), and build the deadline
    scheduler with the config's max_batch."""
    from photon_core.scheduler import CostModel, Scheduler, ThreadedScheduler

    from photon_ros.engine_adapter import HookedEngine

    if model is None:
        model = load_model(config)
    engine = HookedEngine(model, config.debug_ignore_eos, config.debug_step_delay_ms)
    prepare = getattr(model, "prepare_encode", None)     # the fast path: encode graphs of
    if prepare is not None:                              # the cameras' sizes, captured now
        prepare_encodes(prepare, config)
    sizes = tuple(b for b in (1, 2, 4, 8) if b <= config.max_batch) or (1,)
    cost = CostModel.calibrate(engine, clock, batch_sizes=sizes) if calibrate else CostModel()
    sched = Scheduler(engine, cost, clock=clock, max_batch=config.max_batch, on_result=on_result)
    if threaded:
        sched = ThreadedScheduler(sched)
    return LivePipeline(PerceptionPipeline(config, model, model_id=model_id), model, engine,
                        cost, sched)
