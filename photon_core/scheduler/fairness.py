"""Fairness between streams (cameras) under overload.

The rule: **the stream that received the fewest frames of service lately goes first (a
decayed count, half-life `halflife_s`, default 2 s; streams within one frame of each other
count as equal); among equals, earliest deadline first; deadlines in the same `tie_s`
bucket (5 ms) go to the stream served least recently (round robin among equally urgent
work); and, under overload, a stream that is ahead does not grab an idle engine just
because its frame arrived a moment before the frame of a stream that is behind.**
Admission control still checks every start against every deadline (and on-demand work
still goes first): the rule only decides who is *considered* first, so it never makes
admitted work late; at light load everything is served and the order does not matter.

- The unit is **frames served**: each started periodic task adds its share of its frame,
  1 / (the frame's periodic tasks that could meet their deadline on arrival: started at
  once on an idle engine, by the cost model's mean estimate; Scheduler._feasible), at most
  1 per frame. So a camera with 4 tasks per frame is not penalised against one with 1, a
  frame half served counts half (cameras with the same task mix get even results per task),
  and a camera whose extra tasks no engine can answer (a deadline shorter than their own
  cost) does not look under-served: those tasks are not part of its frames' share. (The
  earlier denominator, all the frame's tasks, made such a camera look a third served: it
  got 1.5-2.5x the others' frames. Counting a frame 1 at its first started task instead
  fixed that but let cameras with the same 3-4 task mix drift apart in results per task,
  fairness 0.73-0.84 in the simulator's multi-task rows, because a frame with one task
  answered counted as much as a fully answered one.) The other tasks of a frame already
  being served rank as if it were not served yet (they ride along: the encode is shared,
  finishing the frame is cheap). Max-min fair: a 5 fps camera next to a 30 fps one gets
  all its frames served before the faster one gets more.
- Why frames, not GPU time: a camera's task list is what answering one of its frames
  means; fairness in GPU time would give a camera asking 3 tasks a third of the frame rate
  of a camera asking one, i.e. answers three times staler, and it would charge a camera for
  its scene (more objects, longer decodes) rather than for its request. With frames, a
  camera with heavier tasks does take more GPU time; its tasks still pass admission like
  any other, so it never makes the others' admitted work late.
- Why counts, not EDF (measured, test_fairness.py): with latest frame wins and frames
  published in a fixed order, the first camera of a tick replaces its waiting frame first,
  so its request is always the youngest and plain EDF always prefers the others' older
  frames (9 / 36 / 63 / 65 results); with a slow engine, the first camera always finds the
  engine idle, cameras 1-2 fit behind it and the last one is skipped every tick (240 / 240
  / 236 / 4; the issue's CPU node: 170 / 87 / 88 / 2 in 180 s).
- Why the hold: queue order alone cannot fix the second case, because the winners never
  wait in the queue. So, **only while the scheduler is under pressure** (a periodic request
  was skipped, superseded or cancelled at its deadline within `pressure_s`), a periodic
  request whose stream is ahead of another stream that is *due* (its next frame expected,
  from its own frame period, within `gather_s` of this frame's capture time) and has no
  work waiting is held for at most `gather_s` after its arrival (default min(10 ms, 10 % of
  its relative deadline)); the hold ends as soon as every due stream that is behind has its
  frame in, and then the order above decides. Without pressure there is no hold (waiting
  would only add latency), and a stream that stopped publishing is never due (its expected
  frame lies in the past). Frame periods and "due" use capture times: frames of one tick
  share them, however late the driver or the transport hands them over.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FairShare:
    tie_s: float = 0.005          # deadlines within this bucket are equally urgent
    gather_s: float = 0.010       # longest hold of a request arriving before a due stream
    gather_frac: float = 0.10     # ... and at most this fraction of its relative deadline
    pressure_s: float = 2.0       # a skip / supersede / deadline cancel turns holds on this long
    halflife_s: float = 2.0       # service counts decay with this half-life
    last_started: dict = field(default_factory=dict)   # stream -> clock time it last started
    last_submit: dict = field(default_factory=dict)    # stream -> capture time of its last frame
    period: dict = field(default_factory=dict)         # stream -> frame period (EMA)
    pressure_until: float = float("-inf")
    count: dict = field(default_factory=dict)          # stream -> (frames served, decayed, at time)

    # -- what the scheduler tells it --------------------------------------------------
    def note_frame(self, stream: str, t: float) -> None:
        """A new periodic frame of `stream`, captured at `t`, arrived."""
        last = self.last_submit.get(stream)
        if last is not None and t > last:
            dt = t - last
            p = self.period.get(stream)
            self.period[stream] = dt if p is None else 0.8 * p + 0.2 * dt
        if last is None or t > last:
            self.last_submit[stream] = t

    def note_started(self, stream: str, t: float, frames: float = 1.0) -> None:
        """A request of `stream` started: `frames` of service (its share of its frame, see
        the module doc; 0 for on-demand work, which goes first anyway)."""
        self.last_started[stream] = t
        if frames and self.halflife_s > 0:
            self.count[stream] = (self.served_frames(stream, t) + frames, t)

    def served_frames(self, stream: str, now: float) -> float:
        """Frames of `stream` served lately (decayed count at `now`)."""
        c = self.count.get(stream)
        if c is None:
            return 0.0
        n, t = c
        return n * 0.5 ** (max(0.0, now - t) / self.halflife_s)

    def note_pressure(self, t: float) -> None:
        self.pressure_until = max(self.pressure_until, t + self.pressure_s)

    # -- what it answers ----------------------------------------------------------------
    def served(self, stream: str) -> float:
        return self.last_started.get(stream, float("-inf"))

    def bucket(self, deadline: float) -> float:
        return round(deadline / self.tie_s) if self.tie_s > 0 else deadline

    def share_class(self, stream: str, now: float, riding: float = 0.0) -> int:
        """The fairness class the queue orders by first: frames served lately, in whole
        frames (`riding`: the share of this request's frame already counted; its other
        tasks rank as if the frame were not served yet, so a frame is finished first)."""
        if self.halflife_s <= 0:
            return 0
        n = self.served_frames(stream, now) - riding
        return int(max(0.0, n) + 0.5)

    def expected(self, stream: str) -> float | None:
        last, p = self.last_submit.get(stream), self.period.get(stream)
        return None if last is None or p is None else last + p

    def hold_until(self, stream: str, captured: float, submitted: float, deadline_s: float,
                   now: float, waiting: dict) -> float | None:
        """None: the request may start now. Else the clock time its hold ends: a stream that
        is behind `stream` is due (its next frame expected within the window around this
        frame's capture time) and its frame of that tick is not waiting yet (`waiting`:
        stream -> newest capture time of its waiting periodic work; an older frame still
        waiting does not count, it may be the one that does not fit)."""
        if now >= self.pressure_until or self.gather_s <= 0:
            return None
        window = min(self.gather_s, self.gather_frac * deadline_s)
        end = submitted + window
        if now >= end:
            return None
        mine = self.served_frames(stream, now)
        for s in self.last_submit:
            if s == stream or waiting.get(s, float("-inf")) >= captured - window \
                    or not self.served_frames(s, now) < mine:
                continue
            e = self.expected(s)
            if e is not None and captured - window <= e <= captured + window:
                return end
        return None
