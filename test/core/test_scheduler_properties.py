"""Property tests (hypothesis) over multi-camera traces, including frames of all cameras
stamped at the same tick and submitted in a fixed order: exactly one outcome per request,
no camera starves, batching rules hold (also with batched encode and with an engine that
runs out of memory above a batch size)."""
from __future__ import annotations

import os
import sys
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from photon_core.scheduler import CostModel, Policy, Scheduler, Status, VirtualClock
from photon_core.scheduler.simulator import BatchEncodeSimEngine, SimEngine, SimImage
from photon_core.task import Task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scheduler_ticks import step_until  # noqa: E402

TASKS = {"det": Task("detect", object="person"), "pt": Task("point", object="cup"),
         "never": Task("point", object="door")}     # asked with a 1 ms deadline: always skipped
HOPELESS_S = 0.001


class OOMAbove(BatchEncodeSimEngine):
    """Out of memory (before touching any run) for a step of more than `room` runs."""
    room = 8

    def step_batch(self, runs):
        if len(runs) > self.room:
            raise RuntimeError("CUDA out of memory")
        return super().step_batch(runs)


def run(cams, ticks, period, deadline, steps, names, encode_ms, step_ms, max_batch, engine,
        room, stagger, mixes=None):
    """mixes: the task names of each camera (default: `names` for all); "never" is asked with
    a deadline no engine meets."""
    cost = CostModel(encode_base_ms=0.0, encode_per_crop_ms=encode_ms, prefill_base_ms=1.0,
                     prefill_per_token_ms=0.0,
                     decode_step_ms={1: step_ms, 2: 1.1 * step_ms, 4: 1.3 * step_ms,
                                     8: 1.6 * step_ms}, ema=0.1)
    clock = VirtualClock()
    cls = {"plain": SimEngine, "batch_encode": BatchEncodeSimEngine, "oom": OOMAbove}[engine]
    eng = cls(clock, cost.scaled(1.0), jitter=0.05, seed=3)
    if engine == "oom":
        eng.room = room
    outs, stepped = [], []
    orig = eng.step_batch

    def rec(runs):
        for r in runs:                                      # never a finished/cancelled run
            assert not r.finished
        assert len({id(r) for r in runs}) == len(runs)
        stepped.append(len(runs))
        return orig(runs)
    eng.step_batch = rec
    s = Scheduler(eng, cost.scaled(1.0), clock=clock, policy=Policy(max_batch=max_batch),
                  on_result=outs.append)
    ids = []
    for k in range(ticks):
        t = k * period
        clock.advance_to(t)
        for c in range(cams):                               # fixed order, same stamp
            mine = mixes[c] if mixes else names
            image = SimImage((300, 300), tuple((TASKS[n].target, steps) for n in mine))
            ids += s.submit_frame(f"cam{c}", k, image,
                                  [(n, TASKS[n], HOPELESS_S if n == "never" else deadline)
                                   for n in mine], capture_time=t)
            if stagger and c == 0:
                # like the threaded loop: the first camera's frame comes in alone and the
                # scheduler steps (it may start encoding it); the others arrive meanwhile and
                # are taken from the inbox together before the next step
                s.step()
        step_until(s, clock, t + period)
    s.run_until_idle()
    return s, eng, outs, ids, stepped


common = dict(cams=st.integers(2, 6), ticks=st.integers(20, 60),
              period=st.sampled_from([0.033, 0.066, 0.1, 0.2]),
              deadline=st.floats(0.05, 0.5), steps=st.integers(1, 20),
              names=st.sampled_from([("det",), ("det", "pt")]),
              encode_ms=st.floats(2.0, 60.0), step_ms=st.floats(0.5, 10.0),
              max_batch=st.integers(1, 8), room=st.integers(1, 8), stagger=st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(["plain", "batch_encode", "oom"]), **common)
def test_every_request_one_outcome_and_batching_rules(cams, ticks, period, deadline, steps, names,
                                                      encode_ms, step_ms, max_batch, engine, room,
                                                      stagger):
    s, eng, outs, ids, stepped = run(cams, ticks, period, deadline, steps, names, encode_ms,
                                     step_ms, max_batch, engine, room, stagger)
    got = [o.request_id for o in outs]
    assert sorted(got) == sorted(ids) and len(set(got)) == len(got)   # exactly one outcome each
    assert not eng.open_runs and not s.frames and not s.has_work()
    assert max(stepped or [0]) <= max_batch
    if engine == "oom":
        assert max(stepped or [0]) <= max(room, 1) or s.metrics()["sheds"] >= 1
        if room >= 1:                                       # a batch of 1 always fits: no errors
            assert not [o for o in outs if o.status is Status.ERROR]
    else:
        assert not [o for o in outs if o.status is Status.ERROR]
    if engine == "batch_encode":                            # every frame encoded at most once
        assert eng.calls["encode"] <= cams * ticks
    newest = {}
    for o in outs:                                          # results of a key never go back
        if o.status is Status.DONE:
            k = (o.stream, o.task_name)
            assert k not in newest or o.stamp > newest[k]
            newest[k] = o.stamp


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cams=st.integers(2, 6), period=st.sampled_from([0.05, 0.1, 0.2]),
       per_tick=st.floats(0.3, 0.9), steps=st.integers(2, 12), max_batch=st.sampled_from([1, 4]),
       stagger=st.booleans(), names=st.sampled_from([("det",), ("det", "pt")]))
# found by hypothesis: deadlines so tight that 2 decode steps of estimate decide; the camera
# served first learned a tight per-camera step estimate, the other kept its first loose one
# and was skipped (30 / 4): TokenEstimator.min_own
@example(cams=2, period=0.05, per_tick=0.33203125, steps=7, max_batch=1, stagger=False,
         names=("det",))
# found by hypothesis (seed 27): the same at the 3rd own result, where the key left the
# pooled stats for its own still-loose deviation (15 / 6): TokenEstimator.min_own 3 -> 8
@example(cams=2, period=0.1, per_tick=0.3671875, steps=2, max_batch=1, stagger=False,
         names=("det", "pt"))
def test_no_camera_starves_under_overload(cams, period, per_tick, steps, max_batch, stagger, names):
    """The engine can do `per_tick` x a tick's frames (30-90 %): every camera gets results,
    and none gets less than half of the best-served camera's."""
    frame_ms = 1e3 * period / (per_tick * cams)          # one frame alone (at batch 1)
    encode_ms, step_ms = 0.6 * frame_ms, 0.4 * frame_ms / steps
    s, eng, outs, ids, _ = run(cams, 150, period, 2 * period, steps, names, encode_ms, step_ms,
                               max_batch, "plain", 8, stagger)
    done = Counter(o.stream for o in outs if o.status is Status.DONE and o.task_name == "det")
    got = [done[f"cam{c}"] for c in range(cams)]
    if max(got) >= 10:
        assert min(got) >= 0.5 * max(got), got


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(period=st.sampled_from([0.05, 0.1, 0.2]), per_tick=st.floats(0.3, 0.9),
       steps=st.integers(2, 12), max_batch=st.sampled_from([1, 4]), stagger=st.booleans(),
       mixes=st.lists(st.sampled_from([("det",), ("det", "pt"), ("det", "never"),
                                       ("det", "never", "never")]), min_size=2, max_size=5)
       .filter(lambda m: len(set(m)) > 1))
# found by hypothesis: the stream's task probe picked its 1 ms task (cut at once, nothing
# learnt) and its detect was never re-measured (35 / 3 frames): the probe now takes the
# stream's request with the most time left
@example(period=0.05, per_tick=0.375, steps=4, max_batch=1, stagger=False,
         mixes=[("det", "pt"), ("det", "never")])
# found by hypothesis: the point task's prior step count made it hopeless on every frame and
# it never ran, so its real (2-step) cost was never learnt: cam1's point skipped 150 / 150
# (shares 40 / 20). Task probes are now per (stream, task) for tasks hopeless on arrival
@example(period=0.05, per_tick=0.4375, steps=2, max_batch=1, stagger=False,
         mixes=[("det",), ("det", "pt")])
# found by hypothesis (seed 27): a frame costs ~80 % of its deadline, admission's margins
# refuse every request and only task probes run; they went one per stream in turn, so the
# detect + point camera got half a frame per probe (shares 11 / 5, its point task probed
# once). A stream now wants a probe while served less than a frame in task_probe_after_s,
# and probes go to the (stream, task) key started least recently (probes.py): 8 / 6.5
@example(period=0.2, per_tick=0.3125, steps=2, max_batch=1, stagger=False,
         mixes=[("det",), ("det", "pt")])
def test_even_frames_across_task_mixes(period, per_tick, steps, max_batch, stagger, mixes):
    """Cameras with different task mixes, some asking extra tasks that are always skipped
    (1 ms deadline), under overload: the frame shares served are even across cameras (the
    fairness unit: each started task 1 / its frame's tasks that could meet their deadline,
    so tasks no engine can answer neither count nor make a camera look under-served); and
    the detect results of the one-task-per-frame cameras (detect only, or detect + hopeless
    ones) are even too."""
    cams = len(mixes)
    frame_ms = 1e3 * period / (per_tick * cams)
    encode_ms, step_ms = 0.6 * frame_ms, 0.4 * frame_ms / steps
    s, eng, outs, ids, _ = run(cams, 150, period, 2 * period, steps, ("det",), encode_ms,
                               step_ms, max_batch, "plain", 8, stagger, mixes=mixes)
    share = Counter()
    for o in outs:
        if o.start_time is not None and o.kind == "periodic" and o.task_name != "never":
            c = int(o.stream[3:])
            share[c] += 1 / sum(n != "never" for n in mixes[c])
    shares = [share[c] for c in range(cams)]
    if max(shares) >= 10:
        assert min(shares) >= 0.6 * max(shares), (mixes, shares)
    det = Counter(o.stream for o in outs if o.status is Status.DONE and o.task_name == "det")
    single = [det[f"cam{c}"] for c in range(cams) if "pt" not in mixes[c]]
    if len(single) > 1 and max(single) >= 10:
        assert min(single) >= 0.6 * max(single), (mixes, single, shares)
