"""Probes: work started although the cost model calls it hopeless, so that a wrong estimate
can be corrected (the cost model learns only from what runs). Part of `Scheduler`.

- **Encode probe** (`Policy.probe_after_s`): a request is about to be skipped, nothing runs,
  and the encode of its frame's size and crop mode was last measured long ago: the frame is
  encoded anyway (no task started on a hopeless estimate) and the decision is made again. A
  slow outlier encode cannot skip a camera's frames for good.
- **Task probe** (`Policy.task_probe_after_s`, share `task_probe_share`): a periodic request
  that admission refuses even on an idle engine on arrival is started anyway, on an idle
  engine, when its stream received less than one frame of service (fairness.py's unit) in
  the last task_probe_after_s (every estimate too high: calibration on a loaded machine, a
  GPU hiccup), or when its own task has not started for a while and was never measured (the
  skill's prior step count: a point task whose prior made it hopeless next to a detect that
  runs every frame would never learn its real steps). The latter waits for an idle engine
  rather than being skipped on arrival. Of the requests whose probe is due, the probe is
  the one of the (stream, task) key started least recently (one that could not make its
  deadline even with one decode step last; then the most time left); published if it
  makes its deadline, else its on_miss decides; probes take at most task_probe_share of the
  engine's time.
- Why frames and keys (found by test_scheduler_properties, hypothesis seed 27): near the
  feasibility edge (a frame costs ~80 % of its deadline) admission's margins can refuse
  every request, and then probes are all the service there is. Counted per stream ("no
  task started lately") and within a stream always the same task, they went one per
  stream in turn: a camera asking detect + point got half a frame per probe (shares
  11 / 5), and its point task, measured once with a loose deviation, was never measured
  again. Counted in frames and rotated over (stream, task) keys, every task of every
  camera is re-measured in turn and a camera with two tasks gets two probes for the other
  camera's one: even frame shares (8 / 6.5). A stream served normally gets many frames in
  task_probe_after_s and wants no probe, as before.
"""
from __future__ import annotations

import logging

from . import admission
from .cost_model import encode_key
from .request import PERIODIC, TaskRequest

log = logging.getLogger("photon_core.scheduler")


class Probes:
    """The Scheduler's probe rules (a mixin: it reads the scheduler's policy, clock, queue,
    live runs, token estimator and counters, and starts work through it)."""

    def _probe_due(self, r: TaskRequest, now: float) -> bool:
        """An encode probe is due: frame not encoded, nothing running, and the encode of its
        size and crop mode (encode_key: a global-crop camera's cheap encodes do not stand in
        for a full-crop camera of the same size) last measured probe_after_s ago (or never
        since the scheduler started)."""
        p = self.policy.probe_after_s
        return (p > 0 and not self.live and not r.frame.encoded
                and now - self._encode_seen_at.get(encode_key(r.frame.image), self._t0) >= p)

    def _encode_probe(self, r: TaskRequest, now: float) -> bool:
        """Encode r's frame now to re-measure its cost (see Policy.probe_after_s); True if it
        did. The encoding is kept: the frame's requests start without encoding again."""
        if not self._probe_due(r, now):
            return False
        self.counts["probes"] += 1
        try:
            self._encode(r.frame)
            self._settle_encodes(r.frame)         # the probe's point: its cost, now
        except Exception as e:  # noqa: BLE001 - _start reports it if the request starts
            log.warning("encode probe of a %s frame failed: %r", r.frame.stream, e)
            self._encode_seen_at[encode_key(r.frame.image)] = self.clock.now()
            return False
        return True

    def _task_probe_wanted(self, r: TaskRequest, now: float) -> bool:
        """r wants a task probe (see Policy.task_probe_after_s): r is periodic, not started,
        can still make its deadline if the estimates are wrong, admission refused it even on
        an idle engine on arrival (not merely crowded out by an overload), its (stream,
        task) key has not started for task_probe_after_s (or been submitted that long), and
        either its stream received less than one frame of service in that time (every
        estimate too high; counted in frames, not starts, so a camera with more tasks per
        frame is not probed less per frame than one with a single task), or its task's
        steps were never measured (the skill's prior:
        a stream whose detect runs every frame while its point task's prior made it hopeless
        would never learn the point task's real steps; found by test_scheduler_properties:
        point skipped 150 / 150)."""
        p = self.policy.task_probe_after_s
        if not (p > 0 and r.kind == PERIODIC and not r.admissible and not r.started
                and now < r.deadline):
            return False
        if now - self._key_started.get(r.key, now) < p:
            return False
        return (not self.tokens.measured(r.key)
                or self._frames_served(r.stream, now) < 1.0 - 1e-6)

    def _frames_served(self, stream: str, now: float) -> float:
        """Frames of service (fairness.py's unit: each started periodic task 1 / its frame's
        tasks that could meet their deadline) that `stream` received in the last
        task_probe_after_s."""
        log_ = self._stream_served.get(stream)
        if not log_:
            return 0.0
        self._forget_served(log_, now)
        return sum(f for _, f in log_)

    def _note_served(self, stream: str, t: float, frames: float) -> None:
        """A periodic request of `stream` started at `t`: `frames` of service."""
        log_ = self._stream_served[stream]
        log_.append((t, frames))
        self._forget_served(log_, t)

    def _forget_served(self, log_, now: float) -> None:
        while log_ and log_[0][0] <= now - self.policy.task_probe_after_s:
            log_.popleft()

    def _probe_wait(self, r: TaskRequest, now: float) -> bool:
        """Whether hopeless r, whose task probe could not start now, waits for it (True) or
        is skipped: a request of a task whose steps were never measured waits while its
        probe is wanted and can still start before its deadline - once the running work
        ends, or when the pause after the last probe is over (the scheduler wakes then); a
        busy engine would otherwise skip it on arrival, every time. (A measured task's probe
        starts only when it finds the engine idle: waiting would start it with less time
        left, and its miss would be real; the simulator's 2x-overload rows showed ~1 %.)"""
        if not self._unmeasured_probe(r, now):
            return False
        if self.live:
            return True
        if self._task_probe_ok_at >= r.deadline:
            return False
        self.wake_at = self._task_probe_ok_at if self.wake_at is None \
            else min(self.wake_at, self._task_probe_ok_at)
        return True

    def _unmeasured_probe(self, r: TaskRequest, now: float) -> bool:
        """A wanted probe of a task never measured, which could make its deadline with one
        step (a deadline shorter than the encode + prefill alone is not a matter of steps:
        such requests are skipped at once, as before)."""
        return (not self.tokens.measured(r.key) and self._task_probe_wanted(r, now)
                and not admission.hopeless(now, self._start_ms(r), 1, r.deadline,
                                           self.cost.step_ms))

    def _task_probe_due(self, r: TaskRequest, now: float) -> bool:
        """A task probe starts now: wanted, nothing runs, and the pause after the last probe
        is over."""
        return (not self.live and now >= self._task_probe_ok_at
                and self._task_probe_wanted(r, now))

    def _probe_rank(self, q: TaskRequest, now: float) -> tuple:
        """Which due task probe goes first (smallest): one that could make its deadline with
        a single decode step before one that could not (cut at once, it teaches nothing);
        then the (stream, task) key started least recently; then the most time left."""
        return (admission.hopeless(now, self._start_ms(q), 1, q.deadline, self.cost.step_ms),
                self._key_started.get(q.key, float("-inf")), -q.deadline, q.seq)

    def _task_probe(self, r: TaskRequest, now: float) -> bool:
        """Start a task probe if one is due for r; True if r was started (or ended trying).
        The probe is the waiting request, of any stream, whose probe is due that ranks first
        (_probe_rank: the key started least recently, so a stream's tasks and the streams
        take turns; a task with a deadline no engine meets last, it would teach nothing: cut
        at once, its stream's other tasks never re-measured). Its encode, prefill and steps
        are measured as any run's; it is not protected by admission (its Load is not
        checked)."""
        if not self._task_probe_due(r, now):
            return False
        best = min((q for q in self.queue if not q.ended and self._task_probe_due(q, now)),
                   key=lambda q: self._probe_rank(q, now), default=r)
        if best is not r:
            self._task_probe(best, now)
            return False                          # r itself: skipped as hopeless
        r.probe = True
        self.counts["task_probes"] += 1
        log.info("task probe: %s/%s started although estimated hopeless (estimates re-measured)",
                 r.stream, r.spec.name)
        self._start(r)
        if not r.started and not r.ended:        # start failed and was re-queued
            r.probe = False
        return r.started or r.ended
