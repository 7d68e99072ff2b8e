"""Per-stream (camera) health as the scheduler sees it: rate of results, fraction of its
task requests skipped, time since its last result, and a level with a human reason.

`Scheduler.stream_health()` returns {stream: StreamHealth}; a node publishes one diagnostic
per camera from it (level WARN with `reason` as the message). Counted over a sliding window
(`window_s`, default 10 s) of task requests that *ended*, periodic ones only (on-demand
questions have their own answer channel).

WARN when, for a stream that submitted periodic work within the window:
- **stalled**: no result for `stall_s` (default 3 s), or none at all since it started
  submitting `stall_s` ago;
- **mostly skipped**: at least `min_outcomes` ended in the window and more than
  `skip_frac` (default 50 %) of them were SKIPPED (admission: could not meet the deadline),
  cancelled at the deadline or errors. SUPERSEDED alone is not a fault (latest frame wins:
  a 30 fps camera on a 10 Hz engine is superseded two times in three and still fine);
- **starved**: its result rate is below `unfair_frac` (default 0.5) of the median rate of
  the other streams that submit work (what a fair share would give it).
Otherwise OK ("ok, 9.8 results/s").
"""
from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from .request import PERIODIC, Outcome, Status

OK = "ok"
WARN = "warn"
_BAD = (Status.SKIPPED, Status.DEADLINE, Status.ERROR)


@dataclass
class StreamHealth:
    stream: str
    level: str                   # "ok" | "warn"
    reason: str                  # a human sentence ("ok, 9.8 results/s" / why it is WARN)
    result_rate_hz: float        # DONE periodic results per second over the window
    skipped_frac: float          # (skipped + deadline + error) / ended, over the window
    superseded_frac: float
    since_last_result_s: float | None   # None: no result yet
    submitted: int               # periodic task requests, all time
    done: int                    # all time
    skipped: int                 # all time
    ended_in_window: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Stream:
    first_submit: float
    last_submit: float
    last_result: float | None = None
    ended: deque = field(default_factory=deque)      # (end_time, status)
    totals: Counter = field(default_factory=Counter)


@dataclass
class StreamHealthTracker:
    window_s: float = 10.0
    stall_s: float = 3.0
    skip_frac: float = 0.5
    min_outcomes: int = 5
    unfair_frac: float = 0.5
    streams: dict = field(default_factory=dict)

    def note_submit(self, stream: str, t: float, n: int = 1) -> None:
        s = self.streams.get(stream)
        if s is None:
            s = self.streams[stream] = _Stream(t, t)
        s.last_submit = max(s.last_submit, t)
        s.totals["submitted"] += n

    def note_outcome(self, o: Outcome) -> None:
        if o.kind != PERIODIC:
            return
        s = self.streams.get(o.stream)
        if s is None:
            s = self.streams[o.stream] = _Stream(o.submit_time, o.submit_time)
        s.ended.append((o.end_time, o.status))
        s.totals[o.status.value] += 1
        if o.status is Status.DONE:
            s.last_result = o.end_time if s.last_result is None else max(s.last_result, o.end_time)
        self._trim(s, o.end_time)

    def _trim(self, s: _Stream, now: float) -> None:
        while s.ended and s.ended[0][0] < now - self.window_s:
            s.ended.popleft()

    def report(self, now: float) -> dict[str, StreamHealth]:
        rows = {}
        for name, s in sorted(self.streams.items()):
            self._trim(s, now)
            n = len(s.ended)
            c = Counter(st for _, st in s.ended)
            span = min(self.window_s, max(now - s.first_submit, 1e-9))
            rows[name] = [s, n, c, c[Status.DONE] / span]
        active = {k for k, (s, *_r) in rows.items() if now - s.last_submit <= self.window_s}
        out = {}
        for name, (s, n, c, rate) in rows.items():
            bad = sum(c[x] for x in _BAD)
            since = None if s.last_result is None else now - s.last_result
            skipped_frac = bad / n if n else 0.0
            level, reason = OK, f"ok, {rate:.1f} results/s"
            problems = []
            if name in active:
                if since is None and now - s.first_submit >= self.stall_s:
                    problems.append(f"no result since it started {now - s.first_submit:.0f} s ago "
                                    f"({s.totals['submitted']} task requests)")
                elif since is not None and since >= self.stall_s:
                    problems.append(f"no result for {since:.1f} s")
                if n >= self.min_outcomes and skipped_frac > self.skip_frac:
                    parts = ", ".join(f"{c[x]} {x.value}" for x in _BAD if c[x])
                    problems.append(f"{100 * skipped_frac:.0f} % of its last {n} task requests not "
                                    f"answered ({parts}): the engine cannot meet its deadline")
                others = [rows[k][3] for k in active if k != name]
                if others and now - s.first_submit >= self.stall_s:
                    med = statistics.median(others)
                    if med > 0 and rate < self.unfair_frac * med:
                        problems.append(f"{rate:.1f} results/s vs {med:.1f} for the other "
                                        f"streams (median): starved")
            if problems:
                level, reason = WARN, "; ".join(problems)
            out[name] = StreamHealth(name, level, reason, rate, skipped_frac,
                                     c[Status.SUPERSEDED] / n if n else 0.0, since,
                                     s.totals["submitted"], s.totals["done"], s.totals["skipped"], n)
        return out
