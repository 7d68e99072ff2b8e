"""Adaptive crops: the encode crop mode of the cameras that ask for it stepped down a ladder of
cheaper modes while the scheduler cannot answer their frames in time, and back up once it can.

    from photon_core.scheduler.crop_ladder import AdaptiveCrops
    sched.submit_frame("front", stamp, AdaptiveCrops(frame), tasks)   # the mode: the ladder's

A frame submitted as `AdaptiveCrops(image, modes)` (default modes LADDER: the full overlap
crops, a budget of 4 local crops, the global view; photon_core/encode_request.py) is handed
to the engine as `EncodeRequest(image, crops=<the current mode>)`: the scheduler resolves it
at submission (`Scheduler.crop_ladder`), so the cost model, the batched encode and the engine
only ever see a concrete mode. One level serves every adaptive camera of a scheduler: they
share the GPU, so an overload is everyone's, and no camera keeps a worse mode than another
because its frames happened to be the ones skipped (a per-camera level measured worse in
the simulator: 90.6 vs 93.8 % answered, one camera at full detail while another sat at the
global view). The ladder learns from the adaptive cameras' periodic outcomes (`note`):

- **down** one step when, among the last `window_s` of outcomes at the current mode, at
  least `min_outcomes` ended and more than `down_frac` of them, and at least two, were not
  answered in time: SKIPPED (admission could not fit it), SUPERSEDED (a newer frame of the
  camera came before it could start: the engine does not keep up with the frames), cut at
  the deadline, ERROR, or answered late. (Counting SUPERSEDED too: in the simulator, 4 / 8
  overloaded cameras 93-95 / 78-80 % answered without it, 96-97 / 96-98 % with it, more of
  the frames at the global view; on the H200, call 4 of session 17, without it: 87.6 %.)
  A camera whose frames even the cheapest mode cannot keep up with stays there;
- **up** one step when the current mode has run `hold_s` with no failure in the window; an
  up-step undone (down again) within `hold_s` doubles the hold (up to `max_hold_s`), so a
  load that sits between two modes probes the better one less and less often; an up-step
  that lasts resets it.

Outcomes of frames submitted before the last step are ignored (encoded at the other mode).
Thread-safe: the node asks for modes on its callback threads while the scheduler's thread
notes outcomes.
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from ..encode_request import EncodeRequest, check_crops
from .request import PERIODIC, Outcome, Status

LADDER = ("overlap", "overlap:4", "global")
_FAILED = (Status.SKIPPED, Status.DEADLINE, Status.ERROR, Status.SUPERSEDED)


@dataclass(frozen=True)
class AdaptiveCrops:
    """A frame whose crop mode the scheduler's CropLadder picks among `modes` (best first)."""
    image: Any
    modes: tuple = LADDER

    def __post_init__(self):
        if not self.modes:
            raise ValueError("AdaptiveCrops needs at least one crop mode")
        for m in self.modes:
            check_crops(m)
        if isinstance(self.image, (AdaptiveCrops, EncodeRequest)):
            raise ValueError("AdaptiveCrops wraps a bare image")


@dataclass
class CropLadder:
    window_s: float = 2.0
    min_outcomes: int = 4
    down_frac: float = 0.1
    hold_s: float = 4.0
    max_hold_s: float = 64.0
    level: int = 0                       # index into the frames' modes (0: the best)
    since: float | None = None           # when the current level was entered
    hold: float = 0.0                    # the current up hold
    last_up: float | None = None         # when the last up-step happened
    streams: set = field(default_factory=set)        # the adaptive streams seen
    frames: Counter = field(default_factory=Counter)  # frames resolved per mode
    steps: Counter = field(default_factory=Counter)   # "down" / "up"

    def __post_init__(self):
        self._lock = threading.Lock()
        self._ended: deque = deque()     # (end_time, failed) at the current level
        self._n_modes = 1
        self.hold = self.hold or self.hold_s

    def resolve(self, stream: str, image: Any, now: float) -> Any:
        """An AdaptiveCrops frame -> EncodeRequest(image, crops=the current mode); anything
        else unchanged."""
        if not isinstance(image, AdaptiveCrops):
            return image
        return EncodeRequest(image.image, crops=self.mode(stream, image.modes, now))

    def mode(self, stream: str, modes: tuple, now: float) -> str:
        """The current mode among `modes` (stepping up first where it is due); counts the
        frame under that mode."""
        with self._lock:
            if self.since is None:
                self.since = now
            self.streams.add(stream)
            self._n_modes = len(modes)
            self.level = min(self.level, self._n_modes - 1)
            self._trim(now)
            if self.level > 0 and now - self.since >= self.hold and \
                    not any(f for _, f in self._ended):
                self._step(-1, now)
            if self.last_up is not None and now - self.last_up >= self.hold:
                self.hold, self.last_up = self.hold_s, None    # the up-step held: reset
            m = modes[self.level]
            self.frames[m] += 1
            return m

    def note(self, o: Outcome, now: float) -> None:
        """The outcome of a task on a frame this ladder resolved (the scheduler's call);
        periodic ones count (on-demand questions have their own deadlines)."""
        if o.kind != PERIODIC or o.probe:
            return
        with self._lock:
            if self.since is None or o.submit_time < self.since:
                return
            self._ended.append((o.end_time, o.status in _FAILED or o.missed_deadline))
            self._trim(now)
            n = len(self._ended)
            failed = sum(f for _, f in self._ended)
            if self.level < self._n_modes - 1 and n >= self.min_outcomes and \
                    failed >= 2 and failed > self.down_frac * n:
                if self.last_up is not None and now - self.last_up < self.hold:
                    self.hold = min(2 * self.hold, self.max_hold_s)  # the up-step did not hold
                self.last_up = None
                self._step(+1, now)

    def _step(self, d: int, now: float) -> None:
        self.level += d
        self.since = now
        self._ended.clear()
        self.steps["down" if d > 0 else "up"] += 1
        if d < 0:
            self.last_up = now

    def _trim(self, now: float) -> None:
        while self._ended and self._ended[0][0] < now - self.window_s:
            self._ended.popleft()

    def summary(self) -> dict:
        """The level, the frames resolved per mode, the steps taken ({} before any adaptive
        frame)."""
        with self._lock:
            if not self.streams:
                return {}
            return {"level": self.level, "hold_s": self.hold, "frames": dict(self.frames),
                    "steps": dict(self.steps), "streams": sorted(self.streams)}


__all__ = ["AdaptiveCrops", "CropLadder", "LADDER"]
