"""The scheduler loop: latest frame wins, EDF, admission control, batched decode.

One `step()`:
  1. cancel started runs past their deadline whose task says on_miss="cancel" (DEADLINE);
     skip waiting requests that cannot make their deadline even alone (SKIPPED);
  2. start waiting requests in queue order (on-demand first, then EDF) while the batch has
     room and admission control says they, and everything running, will still make their
     deadlines; a frame is encoded once, by the first of its tasks to start;
     an on-demand request that does not fit yet waits while it has plenty of slack, then
     holds back new periodic work (slack < 2 x preempt_slack x its duration), and starts
     anyway, preempting periodic runs, once slack < preempt_slack x its duration;
  3. one decode step for up to max_batch started runs (on-demand first, then EDF; the rest
     are preempted for this step) through engine.step_batch; finished runs are published,
     and older frames of the same (stream, task) still running are superseded.
Every request ends in exactly one Outcome, delivered to its callback (a callback may call
back in: submit_frame, cancel, metrics).
Single-threaded; `ThreadedScheduler` wraps it for live use. `fifo.py` runs this same loop
with the baseline policy (arrival order, no superseding, no admission, no cancelling).
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from photon_core.task import TaskError

from . import admission
from .clock import Clock, MonotonicClock
from .cost_model import CostModel, TokenEstimator, encode_key
from .edf_queue import EDF, FIFO, RequestQueue
from .encode_batch import encode_batch, has_encode_batch
from .engine import count_prompt_tokens, encodes_queued, engine_capacity, step_batch
from .fairness import FairShare
from .latest_frame import LatestFrameTable
from .load_shedding import BatchLimiter
from .probes import Probes
from .queued_encode import QueuedEncode, setup_ms
from .request import (KINDS, ON_DEMAND, ON_MISS_CANCEL, PERIODIC, Frame, Outcome, Status,
                      TaskRequest, TaskSpec)
from .crop_ladder import AdaptiveCrops, CropLadder
from .stream_health import StreamHealth, StreamHealthTracker

log = logging.getLogger("photon_core.scheduler")
MAX_BATCH_LIMIT = 8


@dataclass
class Policy:
    name: str = "edf"
    order: str = EDF               # queue and batch order: EDF or FIFO
    supersede: bool = True         # latest frame wins for periodic requests
    admission: bool = True         # skip work the cost model says would miss
    cancel_on_miss: bool = True    # honour on_miss="cancel" of started runs
    preempt: bool = True           # on-demand runs take batch slots from periodic runs
    max_batch: int = 4
    max_extra: int = 2             # started on-demand runs allowed beyond max_batch
    safety: float = 1.10           # admission multiplies predicted costs by this
    margin_s: float = 0.0          # ... and wants this much spare time before a deadline
    margin_frac: float = 0.05      # ... plus this fraction of each request's deadline_s
    preempt_slack: float = 2.0     # on-demand starts regardless once its slack < this x its duration
    # The cost model learns an image size's encode cost only from encodes it lets run: an
    # overestimate (a slow outlier) could skip that camera's frames for good. So when a
    # request is about to be skipped, nothing runs, and its frame size's encode was last
    # measured this long ago, the frame is encoded anyway (an encode probe: no task is
    # started on a hopeless estimate) and the decision is made again. 0 disables.
    probe_after_s: float = 2.0
    # The same for the costs of running a task (prefill, decode steps): when a stream got
    # less than one frame of service in task_probe_after_s (all skipped as hopeless: e.g.
    # calibration ran on a loaded CPU or through a GPU hiccup and every estimate is too high),
    # or a task never measured has not started for that long (a task whose prior step count
    # is far above what the scene needs, its steps never learnt because it never ran), and
    # nothing runs, one such request is started anyway (a task probe: published if it makes
    # its deadline, else on_miss decides) so prefill and step costs are measured again; the
    # (stream, task) keys take turns (probes.py). Bounded: one probe at a time, only on an
    # idle engine, at most one per (stream, task) per task_probe_after_s, and after a probe
    # the next waits so that probes take at most task_probe_share of the engine's time.
    # 0 disables.
    task_probe_after_s: float = 2.0
    task_probe_share: float = 0.25
    # Fairness between streams (fairness.py): periodic work of the stream with the fewest
    # frames served lately first, then EDF; equal-urgency ties (deadlines within fair_tie_s)
    # go to the stream served least recently; under pressure (a periodic skip / supersede /
    # deadline cancel within fair_pressure_s) a request of a stream that is ahead waits up to
    # min(fair_gather_s, fair_gather_frac x its deadline_s) for a due stream that is behind.
    fair: bool = True
    fair_tie_s: float = 0.005
    fair_gather_s: float = 0.010
    fair_gather_frac: float = 0.10
    fair_pressure_s: float = 2.0
    fair_halflife_s: float = 2.0   # recent service (frames started per stream) decays with this
    # Regroup (batched-encode engines): when the request at the front of the queue can only
    # start alone (it waited longest; sharing an encode would make it late) or in a small
    # group, but other waiting frames make a larger group that fits now and would not fit
    # after it, that group starts instead (its cameras not ahead of the front one's): under
    # overload more frames served per encode and larger decode batches (docs/architecture.md,
    # "Why decode batches stay small"; bench/sim_scheduler.py --set multicam).
    regroup: bool = True
    # After an engine failure at batch > 1 (GPU out of memory), the batch limit is halved for
    # this long, then raised again (load_shedding.py).
    shed_hold_s: float = 5.0

    def __post_init__(self):
        if not 1 <= self.max_batch <= MAX_BATCH_LIMIT:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH_LIMIT}")
        if not 0 < self.task_probe_share <= 1:
            raise ValueError("task_probe_share must be in (0, 1]")


EDF_POLICY = Policy()


def _finished_early(run: Any) -> bool:
    v = getattr(run, "finished", None)
    if v is None:
        v = getattr(run, "done", False)
    return bool(v() if callable(v) else v)


class Scheduler(Probes):
    def __init__(self, engine: Any, cost_model: CostModel | None = None, *,
                 clock: Clock | None = None, policy: Policy | None = None,
                 max_batch: int | None = None, tokens: TokenEstimator | None = None,
                 on_result: Callable[[Outcome], None] | None = None):
        self.engine = engine
        self.clock = clock or MonotonicClock()
        self.policy = policy or Policy()
        if max_batch is not None:
            self.policy = Policy(**{**self.policy.__dict__, "max_batch": max_batch})
        cap = engine_capacity(engine)
        if cap is not None and self.policy.max_batch + self.policy.max_extra > cap:
            # never open more runs than the engine has slots for (the fast path's KV rows)
            mb = min(self.policy.max_batch, cap)
            self.policy = Policy(**{**self.policy.__dict__, "max_batch": mb,
                                    "max_extra": max(0, cap - mb)})
        self.cost = cost_model or CostModel()
        self.tokens = tokens or TokenEstimator()
        self.on_result = on_result
        p = self.policy
        self.fair = (FairShare(p.fair_tie_s, p.fair_gather_s, p.fair_gather_frac, p.fair_pressure_s,
                               p.fair_halflife_s)
                     if p.fair else FairShare(tie_s=0.0, gather_s=0.0, halflife_s=0.0))
        self.health = StreamHealthTracker()
        self.crop_ladder = CropLadder()           # the crop mode of AdaptiveCrops frames
        self.wake_at: float | None = None     # work is held (fairness) until this clock time
        self.queue = RequestQueue(self.policy.order, self.fair)
        self.limiter = BatchLimiter(self.policy.max_batch, hold_s=p.shed_hold_s)
        self.latest = LatestFrameTable()
        self.live: list[TaskRequest] = []
        self.frames: dict[tuple, Frame] = {}
        self._seq = 0
        self._prompt_cache: dict[tuple, int] = {}
        self.counts: Counter = Counter()
        self._encode_seen_at: dict = {}               # encode_key (size, crop mode) -> last encode measured
        self._key_started: dict[tuple, float] = {}    # (stream, task) -> last periodic start / first submit
        # stream -> (start time, frames of service) of its periodic starts in the last
        # task_probe_after_s (probes.py: a stream served less than a frame in that time)
        self._stream_served: dict[str, deque] = defaultdict(deque)
        self._task_probe_ok_at = float("-inf")        # no task probe before this (probe share)
        self._t0 = self.clock.now()
        self.per_stream: dict[str, Counter] = defaultdict(Counter)
        self.batch_sizes: Counter = Counter()
        self.encode_batch_sizes: Counter = Counter()
        # engine time as the scheduler measured it (ms): encode calls, prefills, decode steps
        self.engine_ms: dict[str, float] = {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
        self._batch_encode = has_encode_batch(engine)
        # encodes returned before the device ran them, measured once the frame's tasks are
        # started (queued_encode.py); only for an engine that declares it (engine.py)
        self._queued_encode = encodes_queued(engine)
        self._pending: list[QueuedEncode] = []

    # -- submitting ------------------------------------------------------------------
    def submit_frame(self, stream: str, stamp: Any, image: Any,
                     tasks: Iterable[TaskSpec | tuple], kind: str = PERIODIC,
                     on_result: Callable[[Outcome], None] | None = None,
                     capture_time: float | None = None) -> list[int]:
        """Queue `tasks` on one frame. `tasks`: TaskSpec or (name, Task, deadline_s[, on_miss]).
        Deadlines count from capture_time (scheduler clock; default now). A frame already
        known (same stream and stamp, tasks still open) is shared, encoding included.
        Returns the request ids; each ends in exactly one Outcome to `on_result`."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        now = self.clock.now()
        fkey = (stream, stamp)
        frame = self.frames.get(fkey)
        if frame is None:              # (an AdaptiveCrops frame takes the ladder's crop mode)
            frame = Frame(stream, stamp, self.crop_ladder.resolve(stream, image, now),
                          now if capture_time is None else capture_time,
                          adaptive=isinstance(image, AdaptiveCrops))
            if kind == PERIODIC:
                self.fair.note_frame(stream, frame.capture_time)
        tasks = list(tasks)
        if kind == PERIODIC:
            self.health.note_submit(stream, now, len(tasks))
        ids = []
        for t in tasks:
            spec = TaskSpec.of(t)
            self._seq += 1
            req = TaskRequest(frame, spec, kind, now, on_result, seq=self._seq)
            frame.refs += 1
            self.frames[fkey] = frame
            ids.append(req.id)
            self.counts["submitted"] += 1
            self.per_stream[stream]["submitted"] += 1
            try:
                spec.task.validate()
            except TaskError as e:
                self._end(req, Status.ERROR, error=f"invalid task: {e}")
                continue
            if kind == PERIODIC:
                self._key_started.setdefault(req.key, now)
                req.admissible = self._admissible(req, now)
                if self._feasible(req, now):
                    frame.tasks += 1              # the fairness share of each of its tasks
            try:
                if kind == PERIODIC and self.policy.supersede:
                    out = self.latest.offer(req)      # may compare stamps: may raise
                    for old in out:
                        if not old.ended:
                            self._end(old, Status.SUPERSEDED)
                    if req in out:
                        continue
                self.queue.add(req)
            except Exception as e:  # noqa: BLE001 - this task's outcome, not the others'
                if not req.ended:
                    self._end(req, Status.ERROR, error=f"submit failed: {type(e).__name__}: {e}")
        return ids

    def cancel(self, request_id: int | None = None, *, stream: str | None = None,
               reason: str = "cancelled") -> int:
        """Cancel one request (by id) or every open request of a stream, or everything when
        both are None. Waiting ones end CANCELLED at once; running ones are stopped between
        steps (their partial TaskResult goes with the outcome). Returns how many ended."""
        n = 0
        for r in list(self.queue) + list(self.live):
            if r.ended or (request_id is not None and r.id != request_id) or \
                    (stream is not None and r.stream != stream):
                continue
            res = self._cancel_run(r, "cancelled") if r.started else None
            self._end(r, Status.CANCELLED, res, error=reason if reason != "cancelled" else "")
            n += 1
        if n and not self.live:
            self._drain_engine()
        return n

    # -- the loop --------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.live)

    def step(self) -> bool:
        """One iteration (expire, admit/start, one decode step). False if idle."""
        if not self.has_work():
            return False
        self._expire()
        self._admit()
        if self.live:
            self._decode()
        if not self.live:
            self._drain_engine()
        return True

    def _drain_engine(self) -> None:
        """Nothing running: let a pipelined engine commit its in-flight steps (frees rows)."""
        drain = getattr(self.engine, "drain", None)
        if drain is not None:
            try:
                drain()
            except Exception as e:  # noqa: BLE001
                log.warning("engine.drain failed: %r", e)

    def idle_until(self) -> float | None:
        """Clock time until which all waiting work is held (fairness) and nothing runs;
        None when the next step() has something to do (or nothing is left)."""
        if self.live or not self.queue or self.wake_at is None:
            return None
        return self.wake_at

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until no work is left. Holds are waited out: a virtual clock is advanced
        to their end, a real one slept through."""
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                break
            until = self.idle_until()
            if until is not None:
                if hasattr(self.clock, "advance_to"):
                    self.clock.advance_to(until)
                else:
                    import time
                    time.sleep(max(0.0, min(until - self.clock.now(), 0.05)))

    # -- internals -------------------------------------------------------------------
    def _feasible(self, r: TaskRequest, now: float) -> bool:
        """Could r meet its deadline on arrival, started at once on an idle engine (the cost
        model's mean estimate)? A task that cannot (a deadline shorter than its own cost) is
        left out of its frame's fairness share (fairness.py), so a camera is not counted as
        under-served for tasks no engine could answer."""
        try:
            steps = self.tokens.estimate(r.key, r.spec.task, conservative=False)
            return not admission.hopeless(now, self._start_ms(r), steps, r.deadline,
                                          self.cost.step_ms)
        except Exception:  # noqa: BLE001 - a cost hint only: count it
            return True

    def _admissible(self, r: TaskRequest, now: float) -> bool:
        """Would admission start r now on an idle engine (conservative estimates, safety,
        margins)? One that would not, on arrival, wants a task probe once its (stream, task)
        has not run for a while (_task_probe_wanted)."""
        try:
            return self._fits(now, self._start_ms(r), self._load(r, now), [],
                              self.policy.max_batch)
        except Exception:  # noqa: BLE001 - a cost hint only
            return True

    def _fits(self, now: float, start_ms: float, cand: admission.Load, live: list,
              mb: int) -> bool:
        """Admission's check with the policy's safety factor and margin."""
        p = self.policy
        return admission.fits(now, start_ms * p.safety, cand, live, mb,
                              lambda b: self.cost.step_ms(b) * p.safety, p.margin_s)

    def _rank(self, r: TaskRequest) -> tuple:
        if self.policy.order == FIFO:
            return (r.seq,)
        on_demand_first = (r.kind != ON_DEMAND) if self.policy.preempt else 0
        return (on_demand_first, r.deadline, r.seq)

    def _prompt_tokens(self, task) -> int:
        k = (task.skill, task.target)
        n = self._prompt_cache.get(k)
        if n is None:
            if len(self._prompt_cache) > 4096:
                self._prompt_cache.clear()
            n = self._prompt_cache[k] = count_prompt_tokens(self.engine, task)
        return n

    def _start_ms(self, r: TaskRequest) -> float:
        enc = 0.0 if r.frame.encoded else self.cost.encode_ms(r.frame.image)
        return enc + self.cost.prefill_ms(self._prompt_tokens(r.spec.task))

    def _load(self, r: TaskRequest, now: float) -> admission.Load:
        est = self.tokens.estimate(r.key, r.spec.task, conservative=True)
        return admission.Load(max(1.0, est - r.steps), r.deadline, self._rank(r),
                              check=now <= r.deadline and not r.probe,   # a probe: ours to learn from
                              margin=self.policy.margin_frac * r.spec.deadline_s)

    def _cancel_run(self, r: TaskRequest, reason: str):
        try:
            r.run.cancel(reason)
            return r.run.result()
        except Exception as e:  # noqa: BLE001
            log.warning("cancel of request %s failed: %r", r.id, e)
            return None

    def _expire(self) -> None:
        now = self.clock.now()
        if self.policy.cancel_on_miss:
            for r in list(self.live):
                if r.ended:                       # a callback may have ended it meanwhile
                    continue
                if now > r.deadline and r.spec.on_miss == ON_MISS_CANCEL:
                    self.tokens.observe_overrun(r.key, r.spec.task, r.steps)
                    self._end(r, Status.DEADLINE, self._cancel_run(r, "deadline"))
        if self.policy.admission:
            for r in self.queue:
                if r.ended:
                    continue
                steps = self.tokens.estimate(r.key, r.spec.task, conservative=False)
                if admission.hopeless(now, self._start_ms(r), steps, r.deadline,
                                      self.cost.step_ms) and not self._probe_due(r, now) \
                        and not self._task_probe_due(r, now) \
                        and not self._unmeasured_probe(r, now):
                    self._end(r, Status.SKIPPED)    # (a due or waiting probe: _admit's)

    def _admit(self) -> None:
        try:
            self._admit_round()
        finally:                                  # before a decode step is timed
            self._settle_encodes()

    def _admit_round(self) -> None:
        p = self.policy
        self.wake_at = None
        mb = self.limiter.limit(self.clock.now())  # max_batch, or less while shedding load
        extra = p.max_extra if mb == p.max_batch else 0
        if not p.admission:                       # baseline: start in order while there is room
            for r in self.queue.ordered():
                if len(self.live) >= mb:
                    return
                self._start(r)
            return
        hold_periodic = False
        step_fn = lambda b: self.cost.step_ms(b) * p.safety  # noqa: E731
        waiting: dict[str, float] = {}            # stream -> newest waiting frame's capture
        for r in self.queue:
            if r.kind == PERIODIC and not r.ended:
                waiting[r.stream] = max(waiting.get(r.stream, r.frame.capture_time),
                                        r.frame.capture_time)
        ordered = self.queue.ordered(self.clock.now())
        for i, r in enumerate(ordered):
            self._settle_encodes()                # decide with the encodes started so far measured
            if r.ended or r.started:              # (started: encoded with an earlier one)
                continue
            n_live = len(self.live)
            if r.kind != ON_DEMAND and (hold_periodic or n_live >= mb):
                break
            now = self.clock.now()
            if r.kind != ON_DEMAND and not r.frame.encoded:
                held = self.fair.hold_until(r.stream, r.frame.capture_time, r.submit_time,
                                            r.spec.deadline_s, now, waiting)
                if held is not None:              # a stream that is behind is due: let it in
                    self.wake_at = held if self.wake_at is None else min(self.wake_at, held)
                    self.counts["fair_holds"] += 1
                    continue
            start_ms = self._start_ms(r)
            steps = self.tokens.estimate(r.key, r.spec.task, False)
            if admission.hopeless(now, start_ms, steps, r.deadline, self.cost.step_ms) and \
                    self._encode_probe(r, now):             # re-measured: decide again
                now, start_ms = self.clock.now(), self._start_ms(r)
            if admission.hopeless(now, start_ms, steps, r.deadline, self.cost.step_ms):
                if not self._task_probe(r, now) and not self._probe_wait(r, now):
                    self._end(r, Status.SKIPPED)
                continue
            cand = self._load(r, now)
            live = [self._load(x, now) for x in self.live]
            ok = n_live < mb and self._fits(now, start_ms, cand, live, mb)
            if ok:
                if not r.frame.encoded and self._batch_encode:
                    self._start_group(r, start_ms, ordered[i + 1:], live, mb, step_fn, waiting)
                else:
                    self._start(r)
                continue
            if not self.live:                     # nothing else running: it alone would miss
                if self._encode_probe(r, now):    # re-measured: decide again next round
                    continue
                if not self._task_probe(r, now):
                    self._end(r, Status.SKIPPED)
                continue
            if r.kind == ON_DEMAND and p.preempt:
                solo = (start_ms + cand.remaining * self.cost.step_ms(mb)) * p.safety / 1e3
                if now + p.preempt_slack * solo >= r.deadline and n_live < mb + extra:
                    self.counts["preempting_starts"] += 1
                    self._start(r)
                elif now + 2 * p.preempt_slack * solo >= r.deadline:
                    hold_periodic = True          # slack getting short: let running work drain
                # else: plenty of slack, periodic work goes on; it will fit in a gap
            # a periodic request that does not fit waits (a newer frame, a freed slot or
            # its own hopelessness will settle it)

    def _start_group(self, r: TaskRequest, start_ms: float, rest: list, live: list, mb: int,
                     step_fn, waiting: dict) -> None:
        """r was admitted: add the next queued requests with frames not encoded while the
        whole group (one batched encode, every prefill) still fits (encode_batch.py), encode
        their frames in one engine call, then start them all. If other waiting frames make a
        larger group than r's that fits now but would not after r (r, the front of the queue,
        has waited longest: typically no slack left to share an encode with anyone, so it
        goes alone), that group starts instead (Policy.regroup; r waits on, usually to be
        skipped)."""
        now = self.clock.now()
        group, frames = self._form_group(r, start_ms, rest, live, mb, step_fn, waiting, now)
        if self.policy.regroup and r.kind == PERIODIC and len(self.live) + len(group) < mb:
            alt = self._regroup(r, rest, live, mb, step_fn, waiting, now, len(frames) + 1)
            if alt is not None:
                group, frames = alt
                self.counts["regroups"] += 1
        if len(frames) > 1:
            try:
                self._encode_many(frames)
            except Exception as e:  # noqa: BLE001 - each request's own start reports it
                log.warning("batched encode of %d frames failed: %r", len(frames), e)
                group = group[:1]
        for q in group:
            if not q.ended and not q.started:
                self._start(q)

    def _form_group(self, r: TaskRequest, start_ms: float, rest: list, live: list, mb: int,
                    step_fn, waiting: dict, now: float) -> tuple[list, list]:
        """(requests, frames) of the group led by r: r, then the requests of `rest` (queue
        order) with frames not encoded while admission says the whole group fits."""
        p = self.policy
        group, loads = [r], [self._load(r, now)]
        frames = [r.frame]
        prefill = start_ms - (0.0 if r.frame.encoded else self.cost.encode_ms(r.frame.image))
        for q in rest:
            if len(self.live) + len(group) >= mb:
                break
            if q.ended or q.started or q.frame.encoded or q is r:
                continue
            if q.kind != ON_DEMAND and self.fair.hold_until(
                    q.stream, q.frame.capture_time, q.submit_time, q.spec.deadline_s, now,
                    waiting) is not None:
                continue
            fr = frames + ([q.frame] if q.frame not in frames else [])
            pre = prefill + self.cost.prefill_ms(self._prompt_tokens(q.spec.task))
            total = self.cost.encode_batch_ms([f.image for f in fr]) + pre
            cand = self._load(q, now)
            if admission.fits(now, total * p.safety, cand, live + loads, mb, step_fn, p.margin_s):
                group.append(q)
                loads.append(cand)
                frames, prefill = fr, pre
        return group, frames

    def _regroup(self, r: TaskRequest, rest: list, live: list, mb: int, step_fn,
                 waiting: dict, now: float, least: int = 2) -> tuple[list, list] | None:
        """A group of >= `least` frames without r's frame that fits now, led by the first
        request of `rest` (queue order) that fits alone and can lead one, whose cameras are
        not more than a frame ahead of r's, and that would not fit after r; else None."""
        p = self.policy
        others = [q for q in rest if q.kind == PERIODIC and not (q.ended or q.started)
                  and not q.frame.encoded and q.frame is not r.frame]
        for i, q in enumerate(others):
            if self.fair.hold_until(q.stream, q.frame.capture_time, q.submit_time,
                                    q.spec.deadline_s, now, waiting) is not None:
                continue
            start_ms = self._start_ms(q)
            if not admission.fits(now, start_ms * p.safety, self._load(q, now), live, mb,
                                  step_fn, p.margin_s):
                continue
            group, frames = self._form_group(q, start_ms, others[i + 1:], live, mb, step_fn,
                                             waiting, now)
            if len(frames) < least:
                continue
            # never at the cost of a camera that is behind the group's (fairness.py)
            mine = self.fair.served_frames(r.stream, now)
            if any(self.fair.served_frames(x.stream, now) > mine + 1.0 for x in group):
                continue
            # r first (projected to its end, with what runs now), then this group: if that
            # fits too, nothing is gained by passing r over
            t_r = max(admission.project(now + self._start_ms(r) * p.safety / 1e3,
                                        live + [self._load(r, now)], mb, step_fn))
            total = self.cost.encode_batch_ms([f.image for f in frames]) + \
                sum(self.cost.prefill_ms(self._prompt_tokens(x.spec.task)) for x in group)
            loads = [self._load(x, now) for x in group]
            if admission.fits(t_r, total * p.safety, loads[-1], loads[:-1], mb, step_fn,
                              p.margin_s):
                return None
            return group, frames
        return None

    def _encode_many(self, frames: list[Frame]) -> None:
        self._encode_call(frames, batched=True)

    def _encode(self, frame: Frame) -> None:
        self._encode_call([frame], batched=False)

    def _encode_call(self, frames: list[Frame], batched: bool) -> None:
        """One engine encode call for `frames` (encode_batch when batched). The frames get
        their encodings now; the call is then measured (_measure: the frames' encode_ms,
        engine_ms, the cost model, setup_ms left out of it) - at once with the call's time
        on the scheduler's clock, or, for an engine that queues encodes (queued_encode.py),
        once settled: their tasks can start first, the prefills queued behind the encode.
        Raises, before anything is recorded, when the engine does."""
        queued = self._queued_encode
        images = [f.image for f in frames]
        t0 = self.clock.now()
        if batched:
            encs = encode_batch(self.engine, images, sync=not queued)
        else:
            encs = [self.engine.encode_image(images[0], sync=False) if queued
                    else self.engine.encode_image(images[0])]
        ms = (self.clock.now() - t0) * 1e3
        self.counts["encode_calls"] += 1
        self.counts["encodes"] += len(frames)
        if batched:
            self.counts["encode_batches"] += 1
            self.encode_batch_sizes[len(frames)] += 1
        for f, enc in zip(frames, encs):
            f.enc, f.encode_ms = enc, ms / len(frames)    # queued: the host's, until settled
        q = QueuedEncode(list(frames), encs, ms, batched)
        if queued:
            self._pending.append(q)
        else:
            self._measure(q, q.host_split())

    def _settle_encodes(self, frame: Frame | None = None) -> None:
        """Measure the queued encodes (all, or the one of `frame`): the device time of each
        (waits for it), into the frames' encode_ms, engine_ms and the cost model, as a
        synchronous encode's host time is (setup_ms left out of the cost model)."""
        if not self._pending:
            return
        done = [q for q in self._pending
                if frame is None or any(x is frame for x in q.frames)]
        self._pending = [q for q in self._pending if not any(q is d for d in done)]
        for q in done:
            try:
                times = q.settle()
            except Exception as e:  # noqa: BLE001 - a timing read; the host's time instead
                self.counts["encode_timing_errors"] += 1
                log.warning("reading the device time of an encode failed: %r", e)
                times = q.host_split()
            self._measure(q, times)

    def _measure(self, q: QueuedEncode, times: tuple[list[float], float]) -> None:
        """An encode call's (per frame ms, call ms) into the frames' encode_ms, engine_ms
        and the cost model (one-time setup inside the call, a graph capture, left out: it is
        not what the next frame will cost)."""
        per, ms = times
        images = [f.image for f in q.frames]
        cost_ms = max(ms - setup_ms(q.encs), 0.0)
        if q.batched:
            self.cost.observe_encode_batch(images, cost_ms)
        else:
            self.cost.observe_encode(images[0], cost_ms)
        self.engine_ms["encode"] += ms
        now = self.clock.now()
        for f, m in zip(q.frames, per):
            f.encode_ms = m
            self._encode_seen_at[encode_key(f.image)] = now

    def _start(self, r: TaskRequest) -> None:
        frame = r.frame
        t_start = self.clock.now()
        try:
            if not frame.encoded:
                self._encode(frame)
            t0 = self.clock.now()
            run = self.engine.start(frame.enc, r.spec.task)
            r.prefill_ms = (self.clock.now() - t0) * 1e3
            self.engine_ms["prefill"] += r.prefill_ms
            self.cost.observe_prefill(self._prompt_tokens(r.spec.task), r.prefill_ms)
        except Exception as e:  # noqa: BLE001 - reported as the request's outcome
            r.start_failures += 1
            if self.live and r.start_failures < self.limiter.max_start_failures:
                # other runs hold engine memory: likely out of room. Shed (hold the batch
                # limit at the runs open) and retry this request later; it stays queued.
                cap = self.limiter.shed(len(self.live), self.clock.now(), e)
                self.counts["sheds"] += 1
                log.warning("start of request %s failed with %d runs open (%r): batch limit "
                            "%d for %.0f s, request retried", r.id, len(self.live), e, cap,
                            self.limiter.hold_s)
                return
            log.warning("start of request %s failed: %r", r.id, e)
            r.start_time = t_start
            self._end(r, Status.ERROR, error=f"{type(e).__name__}: {e}")
            return
        r.run, r.start_time, r.engine_ms = run, t_start, r.prefill_ms
        if r.kind == PERIODIC:
            self._key_started[r.key] = t_start
        self.queue.remove(r)
        self.latest.take(r)
        frames = self.queue.note_started(r, t_start)
        if r.kind == PERIODIC:
            self._note_served(r.stream, t_start, frames)
        self.live.append(r)
        self.counts["admitted"] += 1
        if _finished_early(run) and not r.ended:  # e.g. detect that ends at the prompt
            self._finish(r)

    def _decode(self) -> None:
        ranked = sorted(self.live, key=self._rank)
        mb = self.limiter.limit(self.clock.now())
        batch, rest = ranked[:mb], ranked[mb:]
        for r in rest:
            r.preempted_steps += 1
            self.counts["preempted_steps"] += 1
        t0 = self.clock.now()
        try:
            alive = step_batch(self.engine, [r.run for r in batch])
        except Exception as e:  # noqa: BLE001
            if len(batch) > 1:                    # out of memory? retry in smaller batches
                cap = self.limiter.shed(len(batch) // 2, self.clock.now(), e)
                self.counts["sheds"] += 1
                log.warning("decode step of %d runs failed (%r): batch limit %d for %.0f s, "
                            "runs kept and retried", len(batch), e, cap, self.limiter.hold_s)
                return
            log.warning("decode step failed: %r", e)
            for r in batch:                       # alone: nothing smaller to retry with
                if r.ended:
                    continue
                self._end(r, Status.ERROR, self._cancel_run(r, "cancelled"),
                          error=f"{type(e).__name__}: {e}")
            return
        ms = (self.clock.now() - t0) * 1e3
        self.engine_ms["decode"] += ms
        self.cost.observe_step(len(batch), ms)
        self.counts["steps"] += 1
        self.batch_sizes[len(batch)] += 1
        for r, a in zip(batch, alive):
            if r.ended:                           # a callback of an earlier one ended it
                continue
            r.steps += 1
            r.engine_ms += ms
            if not a:
                self._finish(r)

    def _finish(self, r: TaskRequest) -> None:
        try:
            res = r.run.result()
        except Exception as e:  # noqa: BLE001
            self._end(r, Status.ERROR, error=f"{type(e).__name__}: {e}")
            return
        if res is not None and res.finish_reason in ("stop", "length"):
            self.tokens.observe(r.key, r.spec.task, max(1, int(res.tokens or r.steps)))
        if self.policy.supersede and r.kind == PERIODIC and self.latest.is_stale(r):
            self._end(r, Status.SUPERSEDED, res)
            return
        if (self.policy.cancel_on_miss and r.spec.on_miss == ON_MISS_CANCEL
                and self.clock.now() > r.deadline):
            self._end(r, Status.DEADLINE, res)    # finished, but in the step that crossed it
            return
        self._end(r, Status.DONE, res)
        if self.policy.supersede and r.kind == PERIODIC:
            for x in list(self.live):             # results of a key only move forward
                if x.ended:
                    continue
                if x.key == r.key and x.kind == PERIODIC and not x.frame.stamp > r.frame.stamp:
                    self._end(x, Status.SUPERSEDED, self._cancel_run(x, "cancelled"))

    def _end(self, r: TaskRequest, status: Status, result=None, error: str = "") -> None:
        if r.ended:
            raise RuntimeError(f"request {r.id} ended twice")
        r.ended = True
        f = r.frame
        self._settle_encodes(f)                   # its Outcome carries the encode's real cost
        now = self.clock.now()
        self.queue.remove(r)
        self.latest.take(r)
        if r in self.live:
            self.live.remove(r)
        f.refs -= 1
        if f.refs <= 0:                           # last task of the frame: free the encoding
            f.enc = None
            if self.frames.get((f.stream, f.stamp)) is f:
                del self.frames[(f.stream, f.stamp)]
        missed = (status is Status.DEADLINE) or (status is Status.DONE and now > r.deadline)
        if r.kind == PERIODIC and status in (Status.SKIPPED, Status.SUPERSEDED, Status.DEADLINE):
            self.fair.note_pressure(now)
        if r.probe:                               # probes take at most task_probe_share of the time
            took = now - (r.start_time if r.start_time is not None else now)
            share = self.policy.task_probe_share
            self._task_probe_ok_at = now + took * (1 - share) / share
        if status is Status.DONE:
            self.latest.publish(r)
            self.per_stream[r.stream]["processed"] += 1
        self.counts[status.value] += 1
        if missed:
            self.counts["deadline_misses"] += 1
        if status is Status.DONE and missed:
            self.counts["late"] += 1
        decode_ms = r.engine_ms - r.prefill_ms
        out = Outcome(
            request_id=r.id, stream=r.stream, stamp=f.stamp, task_name=r.spec.name, kind=r.kind,
            status=status, result=result, error=error, capture_time=f.capture_time,
            submit_time=r.submit_time, start_time=r.start_time, end_time=now, deadline=r.deadline,
            queue_ms=((r.start_time if r.start_time is not None else now) - r.submit_time) * 1e3,
            engine_ms=r.engine_ms,
            timings={"encode_ms": f.encode_ms if r.started else 0.0, "prefill_ms": r.prefill_ms,
                     "decode_ms": decode_ms, "preempted_steps": float(r.preempted_steps)},
            steps=r.steps, missed_deadline=missed, probe=r.probe)
        self.health.note_outcome(out)
        if f.adaptive:
            self.crop_ladder.note(out, now)
        for cb in (r.on_result, self.on_result):
            if cb is None:
                continue
            try:
                cb(out)
            except Exception:  # noqa: BLE001 - a broken callback must not stop the loop
                self.counts["callback_errors"] += 1
                log.exception("on_result callback failed")

    # -- diagnostics -----------------------------------------------------------------
    def stream_health(self, now: float | None = None) -> dict[str, StreamHealth]:
        """Per stream: result rate, fraction skipped, time since its last result, level
        ("ok"/"warn") and a human reason (stream_health.py). For a node's /diagnostics."""
        return self.health.report(self.clock.now() if now is None else now)

    def metrics(self) -> dict:
        c = self.counts
        return {
            "submitted": c["submitted"], "admitted": c["admitted"], "done": c["done"],
            "late": c["late"], "superseded": c["superseded"], "skipped": c["skipped"],
            "cancelled": c["cancelled"], "deadline_cancelled": c["deadline"],
            "deadline_misses": c["deadline_misses"], "errors": c["error"],
            "callback_errors": c["callback_errors"], "preempted_steps": c["preempted_steps"],
            "preempting_starts": c["preempting_starts"], "probes": c["probes"],
            "task_probes": c["task_probes"],
            "fair_holds": c["fair_holds"], "sheds": c["sheds"], "regroups": c["regroups"],
            "batch_limit": self.limiter.limit(self.clock.now()),
            "encodes": c["encodes"], "encode_calls": c["encode_calls"],
            "encode_timing_errors": c["encode_timing_errors"],   # queued encodes host-timed
            "engine_ms": {k: round(v, 3) for k, v in self.engine_ms.items()},
            "decode_steps": c["steps"], "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "encode_batches": dict(sorted(self.encode_batch_sizes.items())),
            "waiting": len(self.queue), "running": len(self.live),
            "per_stream": {s: {"submitted": v["submitted"], "processed": v["processed"]}
                           for s, v in sorted(self.per_stream.items())},
            "cost_factors": {"encode": self.cost.f_encode, "prefill": self.cost.f_prefill,
                             "step": self.cost.f_step},
            "crop_ladder": self.crop_ladder.summary(),
        }
