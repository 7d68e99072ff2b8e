"""Live use: the scheduler loop on its own thread.

`submit_frame` may be called from any thread (ROS callbacks) and never waits for the
engine; outcomes are delivered from the scheduler thread through the callbacks. Nothing is
ever dropped silently: every submitted task request ends in exactly one Outcome, including
those submitted after `stop()` (CANCELLED, error "scheduler stopped": delivered by the
scheduler thread while it still runs, e.g. during a drain, else in the submitting thread)
and those still open when it stops.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from .request import PERIODIC, Frame, Outcome, Status, TaskRequest, TaskSpec
from .scheduler import Scheduler

log = logging.getLogger("photon_core.scheduler")


class ThreadedScheduler:
    def __init__(self, scheduler: Scheduler, idle_wait_s: float = 0.05, name: str = "photon-scheduler"):
        self.sched = scheduler
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()        # guards the inbox and the stop flags
        self._state = threading.RLock()         # guards the scheduler (held while it steps)
        self._inbox: list[tuple] = []
        self._stopping = False
        self._closed = False                    # the loop has finished with the inbox for good
        self._drain = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------
    def submit_frame(self, stream: str, stamp: Any, image: Any, tasks: Iterable[TaskSpec | tuple],
                     kind: str = PERIODIC, on_result: Callable[[Outcome], None] | None = None,
                     capture_time: float | None = None) -> None:
        tasks = [TaskSpec.of(t) for t in tasks]
        if capture_time is None:
            capture_time = self.sched.clock.now()
        item = (stream, stamp, image, tasks, kind, on_result, capture_time)
        with self._cv:
            if not self._closed:
                # stopping: still queued, the loop answers it "scheduler stopped" at once
                # (a caller never waits for a drain or a long engine step to end)
                self._inbox.append(("__reject__", item) if self._stopping else item)
                self._cv.notify()
                return
        self._reject(*item)

    def cancel(self, request_id: int | None = None, *, stream: str | None = None) -> None:
        with self._cv:
            self._inbox.append(("__cancel__", request_id, stream))
            self._cv.notify()

    def metrics(self) -> dict:
        with self._state:
            return self.sched.metrics()

    @property
    def crop_ladder(self):
        """The scheduler's CropLadder (its own lock: any thread)."""
        return self.sched.crop_ladder

    def stream_health(self) -> dict:
        """{stream: StreamHealth} (see Scheduler.stream_health); any thread."""
        with self._state:
            return self.sched.stream_health()

    @property
    def error(self) -> BaseException | None:
        """What killed the scheduler thread, if something did (open work was cancelled)."""
        return self._error

    def stop(self, drain: bool = False, timeout: float | None = 10.0) -> None:
        """Stop the thread. drain=True finishes the open work first (new submissions are
        refused meanwhile); otherwise open work is cancelled (CANCELLED outcomes)."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        if threading.current_thread() is not self._thread:   # stop() from a callback: no join
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- scheduler thread ----------------------------------------------------------------
    def _reject(self, stream, stamp, image, tasks, kind, on_result, capture_time):
        """Outcome for a submission the stopped scheduler will never run."""
        with self._state:
            now = self.sched.clock.now()
            for spec in tasks:
                frame = Frame(stream, stamp, None, capture_time, refs=1)
                r = TaskRequest(frame, spec, kind, now, on_result)
                self.sched.counts["submitted"] += 1
                self.sched._end(r, Status.CANCELLED, error="scheduler stopped")

    def _take_inbox(self) -> None:
        with self._cv:
            items, self._inbox = self._inbox, []
        for it in items:
            if it[0] == "__cancel__":
                self.sched.cancel(it[1], stream=it[2])
                continue
            if it[0] == "__reject__":
                self._reject(*it[1])
                continue
            stream, stamp, image, tasks, kind, on_result, cap = it
            try:
                self.sched.submit_frame(stream, stamp, image, tasks, kind, on_result, cap)
            except Exception as e:  # noqa: BLE001 - bad arguments still get an outcome
                log.warning("submit failed: %r", e)
                now = self.sched.clock.now()
                for spec in tasks:
                    self.sched.counts["submitted"] += 1
                    frame = Frame(stream, stamp, None, cap, refs=1)
                    self.sched._end(TaskRequest(frame, spec, PERIODIC if kind not in ("periodic", "on_demand") else kind,
                                                now, on_result), Status.ERROR, error=f"submit failed: {e}")

    def _loop(self) -> None:
        try:
            while True:
                with self._state:
                    self._take_inbox()
                with self._cv:
                    stopping, drain = self._stopping, self._drain
                    if not stopping and not self._inbox and not self.sched.has_work():
                        self._cv.wait(self.idle_wait_s)
                        continue
                if stopping and (not drain or not self.sched.has_work()):
                    break
                with self._state:
                    self.sched.step()
                    until = self.sched.idle_until()
                if until is not None:             # work held for fairness: wait, not spin
                    with self._cv:
                        if not self._inbox and not self._stopping:
                            self._cv.wait(max(0.0, min(until - self.sched.clock.now(),
                                                       self.idle_wait_s)))
        except BaseException as e:  # noqa: BLE001 - make sure nothing is left without an outcome
            self._error = e
            log.exception("scheduler thread failed")
        finally:
            with self._cv:
                self._stopping = True
            with self._state:
                self._take_inbox()
                self.sched.cancel(reason="scheduler stopped")
                with self._cv:                # later submissions are rejected by the caller
                    self._closed = True
                self._take_inbox()            # what came in meanwhile (rejections)
