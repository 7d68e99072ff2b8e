"""The simulator drives the real scheduler: targets on the trace grid, determinism, and
property tests (hypothesis) of the invariants over random traces and random operations."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photon_core.scheduler import CostModel, Policy, Scheduler, Status, VirtualClock
from photon_core.scheduler.request import ON_MISS_CANCEL, PERIODIC
from photon_core.scheduler.simulator import (GRID_CAMERAS, GRID_FPS, SimEngine, SimImage, TraceSpec,
                                             make_trace, simulate, table)
from photon_core.task import Task


def check_invariants(res, spec):
    """What must hold for any trace under the EDF policy."""
    events = make_trace(spec)
    n_requests = sum(len(e.tasks) for e in events)
    ids = [o.request_id for o in res.outcomes]
    assert len(ids) == n_requests and len(set(ids)) == n_requests      # one outcome each
    assert res.engine_open_runs == 0 and res.frames_left == 0          # everything freed
    assert res.metrics["stale"] == 0                                   # results never go back
    assert res.metrics["errors"] == 0
    assert max(res.sched_metrics["batch_sizes"] or {0: 0}) <= spec.max_batch
    for o in res.outcomes:
        if o.status is Status.DONE and o.kind == PERIODIC:
            spec_miss = [t for t in spec.tasks if t.name == o.task_name][0].on_miss
            if spec_miss == ON_MISS_CANCEL:                             # never published late
                assert o.end_time <= o.deadline + 1e-9
        if o.status in (Status.SKIPPED, Status.SUPERSEDED) and o.start_time is None:
            assert o.engine_ms == 0


@pytest.mark.parametrize("cameras", GRID_CAMERAS)
@pytest.mark.parametrize("fps", GRID_FPS)
def test_targets_on_the_grid(cameras, fps):
    """docs/benchmarks.md targets, on 5 s traces (the bench runs 20 s)."""
    over = simulate(TraceSpec(cameras=cameras, fps=fps, load=2.0, duration_s=5.0), "edf")
    m = over.metrics
    assert m["miss_rate"] <= 0.01
    assert m["stale"] == 0
    assert m["age_p99"] <= 2.0
    assert m["answered"] > 0.2
    check_invariants(over, over.spec)
    fifo = simulate(TraceSpec(cameras=cameras, fps=fps, load=2.0, duration_s=5.0), "fifo")
    assert fifo.metrics["miss_rate"] > 0.5 and fifo.metrics["age_p99"] > 2.0   # the contrast
    light = simulate(TraceSpec(cameras=cameras, fps=fps, load=0.5, duration_s=5.0), "edf")
    assert light.metrics["answered"] == 1.0 and light.metrics["misses"] == 0
    assert light.metrics["on_demand_ok"] == 1.0 or math.isnan(light.metrics["on_demand_ok"])


def test_simulation_is_deterministic():
    spec = TraceSpec(cameras=2, fps=30, load=1.5, duration_s=2.0, seed=3)
    a, b = simulate(spec, "edf"), simulate(spec, "edf")
    assert repr(a.metrics) == repr(b.metrics)          # (nan-safe)
    assert [(o.request_id - a.outcomes[0].request_id, o.status, o.end_time) for o in a.outcomes] == \
           [(o.request_id - b.outcomes[0].request_id, o.status, o.end_time) for o in b.outcomes]


def test_table_formats():
    r = simulate(TraceSpec(cameras=1, fps=15, load=0.5, duration_s=1.0), "edf")
    t = table([r])
    assert t.count("\n") == 2 and "| edf |" in t


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cameras=st.integers(1, 4), fps=st.sampled_from([10.0, 15.0, 30.0]),
       load=st.floats(0.2, 3.0), seed=st.integers(0, 10_000), max_batch=st.integers(1, 8),
       on_demand_rate=st.sampled_from([0.0, 1.0, 4.0]), jitter=st.floats(0.0, 0.3),
       deadline_periods=st.floats(1.0, 4.0))
def test_invariants_on_random_traces(cameras, fps, load, seed, max_batch, on_demand_rate, jitter,
                                     deadline_periods):
    spec = TraceSpec(cameras=cameras, fps=fps, load=load, duration_s=1.5, seed=seed,
                     max_batch=max_batch, on_demand_rate=on_demand_rate, jitter=jitter,
                     deadline_periods=deadline_periods)
    check_invariants(simulate(spec, "edf"), spec)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cameras=st.integers(1, 3), load=st.floats(0.2, 3.0), seed=st.integers(0, 10_000),
       max_batch=st.integers(1, 8))
def test_fifo_answers_everything_in_order(cameras, load, seed, max_batch):
    spec = TraceSpec(cameras=cameras, fps=15.0, load=load, duration_s=1.0, seed=seed, max_batch=max_batch)
    res = simulate(spec, "fifo")
    assert all(o.status is Status.DONE for o in res.outcomes)
    starts = [o.start_time for o in sorted(res.outcomes, key=lambda o: o.request_id)]
    assert starts == sorted(starts)                                    # arrival order
    assert res.engine_open_runs == 0 and res.frames_left == 0


COST = CostModel(encode_base_ms=0.0, encode_per_crop_ms=4.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 8: 4.0}, ema=0.0)
TASKS = {"det": Task("detect", object="person"), "pt": Task("point", object="cup"),
         "ask": Task("query", question="Why?", max_tokens=40)}
op = st.one_of(
    st.tuples(st.just("frame"), st.sampled_from(["a", "b"]), st.integers(0, 12),
              st.lists(st.sampled_from(["det", "pt"]), min_size=1, max_size=2, unique=True),
              st.integers(1, 30), st.floats(0.005, 0.3), st.sampled_from(["cancel", "finish"])),
    st.tuples(st.just("ask"), st.sampled_from(["a", "b"]), st.integers(0, 12), st.integers(1, 40),
              st.floats(0.01, 1.0)),
    st.tuples(st.just("step"), st.integers(1, 5)),
    st.tuples(st.just("wait"), st.floats(0.0, 0.05)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("cancel_stream"), st.sampled_from(["a", "b"])),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, max_size=40), max_batch=st.integers(1, 8), preempt=st.booleans())
def test_invariants_under_random_operations(ops, max_batch, preempt):
    """Out-of-order stamps, shared frames, cancels at any point, preemption on or off."""
    clock = VirtualClock()
    eng = SimEngine(clock, COST.scaled(1.0), jitter=0.1, seed=1)
    outs = []
    s = Scheduler(eng, COST.scaled(1.0), clock=clock,
                  policy=Policy(max_batch=max_batch, preempt=preempt), on_result=outs.append)
    ids = []
    for o in ops:
        if o[0] == "frame":
            _, stream, stamp, names, steps, dl, miss = o
            image = SimImage((100, 100), tuple((TASKS[n].target, steps) for n in names))
            ids += s.submit_frame(stream, stamp, image, [(n, TASKS[n], dl, miss) for n in names])
        elif o[0] == "ask":
            _, stream, stamp, steps, dl = o
            image = SimImage((100, 100), ((TASKS["ask"].target, steps),))
            ids += s.submit_frame(stream, stamp, image, [("ask", TASKS["ask"], dl, "finish")],
                                  kind="on_demand")
        elif o[0] == "step":
            for _ in range(o[1]):
                s.step()
        elif o[0] == "wait":
            clock.advance(o[1])
        elif o[0] == "cancel" and ids:
            s.cancel(ids[o[1] % len(ids)])
        elif o[0] == "cancel_stream":
            s.cancel(stream=o[1])
        assert max(s.metrics()["batch_sizes"] or {0: 0}) <= max_batch
    s.run_until_idle()
    got = [o.request_id for o in outs]
    assert sorted(got) == sorted(ids) and len(set(got)) == len(got)   # exactly one outcome each
    assert not eng.open_runs and not s.frames and not s.has_work()
    newest = {}
    for o in outs:                                                     # in delivery order
        if o.status is Status.DONE and o.kind == PERIODIC:
            k = (o.stream, o.task_name)
            assert k not in newest or o.stamp > newest[k]
            newest[k] = o.stamp
            assert o.end_time <= o.deadline + 1e-9 or o.missed_deadline
    m = s.metrics()
    assert m["submitted"] == len(ids)
    assert sum(m[k] for k in ("done", "superseded", "skipped", "cancelled", "deadline_cancelled",
                              "errors")) == len(ids)


def test_multicam_crop_modes_and_engine_time():
    """bench_live.py's 4 x 15 fps / 100 ms rows on the H200 profile (engine with encode_batch):
    the invariants hold; a global-crop camera's encode costs 6.43 ms at 640x480 (the profile's
    measurement), a full-crop one 16.21 ms; engine time (encode + prefill + decode, measured by
    the scheduler around its engine calls) is at most the elapsed time, and global crops spend
    a smaller share of it encoding and answer more frames."""
    from photon_core.scheduler.cost_profiles import h200_moondream2
    from photon_core.scheduler.simulator import MULTICAM_SET, run_multicam
    cm = h200_moondream2()
    assert cm.encode_ms(SimImage((480, 640), crops="global")) == pytest.approx(6.43, rel=0.01)
    assert cm.encode_ms(SimImage((480, 640))) == pytest.approx(16.21, rel=0.01)
    rows = [r for r in MULTICAM_SET if len(r) > 6 and r[0] == 4]
    res = {r.spec.crops: r for r in run_multicam(duration_s=4, policies=("edf",), rows=rows)}
    for r in res.values():
        check_invariants(r, r.spec)
        busy = r.metrics["busy"]
        assert set(busy) == {"encode", "prefill", "decode"} and 0.5 < sum(busy.values()) <= 1.0 + 1e-6
        assert r.metrics["mean_encode_batch"] >= 1.0
        assert r.sched_metrics["encodes"] >= r.sched_metrics["encode_calls"] > 0
    g, o = res["global"].metrics, res["overlap"].metrics
    assert g["busy"]["encode"] < o["busy"]["encode"] and g["on_time"] > o["on_time"]


def test_region_steps_stop_at_the_object_budget():
    """A detect / point trace step count: per object found, plus the step that finds no
    more - none once max_objects objects are found (the engines end the task there)."""
    from photon_core.scheduler.simulator import PERSON5, PeriodicTask, region_steps
    assert [region_steps(PERSON5, n) for n in (0, 1, 4, 5, 9)] == [1, 4, 13, 15, 15]
    pt = PeriodicTask("p", Task("point", object="cup", max_objects=2), objects=1.0,
                      per_object=2)
    assert [region_steps(pt, n) for n in (0, 1, 2, 3)] == [1, 3, 4, 4]


def test_mean_steps_is_the_mean_of_the_drawn_scenes():
    """PeriodicTask.mean_steps (the load definition's cost) is the expected region_steps of
    the Poisson object counts the trace draws: capped at max_objects (PERSON5: lambda 5, at
    most 5 objects), per_object x objects + 1 where the cap is out of reach."""
    import random
    from photon_core.scheduler.simulator import (PERSON5, TASK_MIX, _poisson,
                                                 region_steps)
    rng = random.Random(3)
    draws = [region_steps(PERSON5, _poisson(rng, PERSON5.objects)) for _ in range(40000)]
    assert abs(sum(draws) / len(draws) - PERSON5.mean_steps()) < 0.05
    assert PERSON5.mean_steps() < PERSON5.per_object * PERSON5.objects + 1 - 2
    for pt in TASK_MIX:
        if pt.per_object:
            assert pt.mean_steps() == pytest.approx(pt.per_object * pt.objects + 1, abs=1e-9)
        else:
            assert pt.mean_steps() == sum(pt.fixed_steps) / 2
