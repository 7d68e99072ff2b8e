"""Unit tests of each scheduling rule, on the simulator's engine (virtual clock)."""
from __future__ import annotations

import threading

import pytest

from photon_core.scheduler import (CostModel, Outcome, Policy, Scheduler, Status, TaskSpec,
                                   ThreadedScheduler, VirtualClock, fifo_scheduler, project)
from photon_core.scheduler.simulator import SimEngine, SimImage
from photon_core.task import Task

# 10 ms encode (1 crop), 1 ms prefill, 2 ms per decode step (+0.5 per extra run)
COST = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5}, ema=0.0)
DET = Task("detect", object="person")
PNT = Task("point", object="cup")
ASK = Task("query", question="What is this?", max_tokens=64)


def img(**steps):
    """A simulated 1-crop image; steps: task target -> decode steps."""
    return SimImage((300, 300), tuple(steps.items()))


def make(policy=None, max_batch=4, cost=COST):
    clock = VirtualClock()
    eng = SimEngine(clock, cost.scaled(1.0), jitter=0.0)
    outs: list[Outcome] = []
    s = Scheduler(eng, cost.scaled(1.0), clock=clock, policy=policy or Policy(max_batch=max_batch),
                  on_result=outs.append)
    return s, eng, clock, outs


def by_stamp(outs):
    return {(o.stream, o.stamp, o.task_name): o for o in outs}


def test_latest_frame_supersedes_queued_request():
    s, eng, clock, outs = make()
    for k in range(3):
        s.submit_frame("cam", k, img(person=4), [("det", DET, 1.0)])
    s.run_until_idle()
    st = {o.stamp: o.status for o in outs}
    assert st == {0: Status.SUPERSEDED, 1: Status.SUPERSEDED, 2: Status.DONE}
    assert eng.calls["encode"] == 1 and s.metrics()["superseded"] == 2


def test_other_streams_and_tasks_do_not_supersede():
    s, _, _, outs = make()
    s.submit_frame("a", 0, img(person=2, cup=2), [("det", DET, 1.0), ("pt", PNT, 1.0)])
    s.submit_frame("b", 0, img(person=2), [("det", DET, 1.0)])
    s.submit_frame("a", 1, img(cup=2), [("pt", PNT, 1.0)])       # supersedes only a/pt@0
    s.run_until_idle()
    got = {(o.stream, o.stamp, o.task_name): o.status for o in outs}
    assert got == {("a", 0, "pt"): Status.SUPERSEDED, ("a", 0, "det"): Status.DONE,
                   ("b", 0, "det"): Status.DONE, ("a", 1, "pt"): Status.DONE}


def test_older_frame_arriving_after_newer_is_superseded_on_arrival():
    s, _, _, outs = make()
    s.submit_frame("cam", 5, img(person=2), [("det", DET, 1.0)])
    s.run_until_idle()
    s.submit_frame("cam", 3, img(person=2), [("det", DET, 1.0)])   # out of order
    assert outs[-1].status is Status.SUPERSEDED and outs[-1].stamp == 3
    s.submit_frame("cam", 5, img(person=2), [("det", DET, 1.0)])   # same stamp again
    assert outs[-1].status is Status.SUPERSEDED


def test_running_older_frame_is_superseded_when_newer_result_lands():
    s, eng, clock, outs = make()
    s.submit_frame("cam", 0, img(person=30), [("det", DET, 1.0)])
    s.step()                                               # frame 0 starts (long)
    s.submit_frame("cam", 1, img(person=2), [("det", DET, 1.0)])
    s.run_until_idle()
    st = {o.stamp: o.status for o in outs}
    assert st == {0: Status.SUPERSEDED, 1: Status.DONE}
    assert outs[0].stamp == 1                              # newer published first, older never
    assert not eng.open_runs


def test_edf_order_with_one_slot():
    s, _, _, outs = make(max_batch=1)
    order = []
    s.on_result = lambda o: order.append(o.stream)
    for name, dl in (("late", 0.9), ("soon", 0.3), ("mid", 0.6)):
        s.submit_frame(name, 0, img(person=3), [("det", DET, dl)])
    s.run_until_idle()
    assert order == ["soon", "mid", "late"]


def test_fifo_baseline_keeps_arrival_order_and_every_frame():
    clock = VirtualClock()
    eng = SimEngine(clock, COST.scaled(1.0), jitter=0.0)
    outs = []
    s = fifo_scheduler(eng, COST.scaled(1.0), clock=clock, max_batch=1, on_result=outs.append)
    for name, dl in (("late", 0.9), ("soon", 0.3), ("mid", 0.6)):
        s.submit_frame(name, 0, img(person=3), [("det", DET, dl)])
    s.submit_frame("late", 1, img(person=3), [("det", DET, 0.01)])   # hopeless: FIFO runs it anyway
    s.run_until_idle()
    assert [o.stream for o in outs] == ["late", "soon", "mid", "late"]
    assert all(o.status is Status.DONE for o in outs) and outs[-1].missed_deadline


def test_admission_skips_hopeless_work_without_starting_it():
    s, eng, _, outs = make()
    # 10 ms encode + 1 ms prefill + >= 1 step: a 5 ms deadline cannot be met
    s.submit_frame("cam", 0, img(person=4), [("det", DET, 0.005)])
    s.run_until_idle()
    assert outs[0].status is Status.SKIPPED and outs[0].start_time is None
    assert eng.calls["encode"] == 0 and eng.calls["start"] == 0
    assert s.metrics()["skipped"] == 1


def test_admission_protects_running_work():
    # one running task needs ~all of its slack; starting another frame (10 ms encode) would
    # make it miss, so the newcomer waits and is skipped once hopeless
    s, _, clock, outs = make()
    s.tokens.observe(("a", "det"), DET, 20)
    # estimate 31 steps (mean + 2 dev + 1) x 2 ms + 11 ms start, x1.15 safety = 84 ms
    s.submit_frame("a", 0, img(person=20), [("det", DET, 0.090)])
    s.step()
    s.submit_frame("b", 0, img(person=20), [("det", DET, 0.100)])
    s.run_until_idle()
    st = {o.stream: o.status for o in outs}
    assert st["a"] is Status.DONE and not by_stamp(outs)[("a", 0, "det")].missed_deadline
    assert st["b"] is Status.SKIPPED and by_stamp(outs)[("b", 0, "det")].start_time is None


def test_deadline_cancel_and_finish():
    s, eng, _, outs = make()
    # the estimator thinks 2 steps; the frame really takes 40 -> it overruns its deadline
    s.tokens.observe(("c", "det"), DET, 2)
    s.tokens.observe(("f", "det"), DET, 2)
    s.submit_frame("c", 0, img(person=40), [TaskSpec("det", DET, 0.060, "cancel")])
    s.submit_frame("f", 0, img(person=40), [TaskSpec("det", DET, 0.060, "finish")])
    s.run_until_idle()
    o = {x.stream: x for x in outs}
    assert o["c"].status is Status.DEADLINE and o["c"].missed_deadline
    assert o["c"].result.finish_reason == "deadline" and o["c"].steps < 40
    assert o["f"].status is Status.DONE and o["f"].missed_deadline and o["f"].steps == 40
    assert s.metrics()["deadline_misses"] == 2 and not eng.open_runs


def test_cancel_pending_and_running_frees_resources():
    s, eng, _, outs = make()
    a = s.submit_frame("a", 0, img(person=50), [("det", DET, 5.0)])
    b = s.submit_frame("b", 0, img(person=50), [("det", DET, 5.0), ("pt", PNT, 5.0)])
    s.step()
    assert eng.open_runs and s.frames
    assert s.cancel(a[0]) == 1
    assert s.cancel(stream="b") == 2
    assert not eng.open_runs and not s.frames and not s.has_work()
    assert {o.request_id: o.status for o in outs} == {i: Status.CANCELLED for i in a + b}
    assert s.cancel(a[0]) == 0                         # ended requests stay ended


def test_on_demand_preempts_periodic_between_steps():
    s, eng, _, outs = make(max_batch=2)
    batches = []
    orig = eng.step_batch
    eng.step_batch = lambda runs: (batches.append([r.task.skill for r in runs]), orig(runs))[1]
    s.submit_frame("cam", 0, img(person=100, cup=100), [("det", DET, 10.0), ("pt", PNT, 10.0)])
    s.step()
    s.step()                                            # two periodic runs fill the batch
    # a question whose slack is short: it must start now and take a slot
    s.submit_frame("cam", 1, SimImage((300, 300), (("What is this?", 10),)),
                   [TaskSpec("ask", ASK, 0.15, "finish")], kind="on_demand")
    s.step()
    assert "query" in batches[-1] and len(batches[-1]) == 2
    s.run_until_idle()
    o = {x.task_name: x for x in outs}
    assert o["ask"].status is Status.DONE and not o["ask"].missed_deadline
    assert s.metrics()["preempted_steps"] > 0
    assert o["det"].timings["preempted_steps"] + o["pt"].timings["preempted_steps"] > 0
    assert max(len(b) for b in batches) <= 2


def test_on_demand_waits_for_running_work_when_it_has_slack():
    s, _, _, outs = make(max_batch=1)
    s.submit_frame("cam", 0, img(person=5), [("det", DET, 1.0)])
    s.step()
    s.submit_frame("cam", 0, img(), [TaskSpec("ask", ASK, 5.0, "finish")], kind="on_demand")
    s.submit_frame("cam", 1, img(person=5), [("det", DET, 1.0)])
    s.run_until_idle()
    assert [o.task_name for o in outs][:2] == ["det", "ask"]     # no new periodic work first
    assert s.metrics()["preempted_steps"] == 0


@pytest.mark.parametrize("max_batch", [1, 2, 4, 8])
def test_batches_never_exceed_max_batch(max_batch):
    s, _, _, outs = make(max_batch=max_batch)
    for c in range(12):
        s.submit_frame(f"cam{c}", 0, img(person=6), [("det", DET, 5.0)])
    s.run_until_idle()
    sizes = s.metrics()["batch_sizes"]
    assert max(sizes) == max_batch and len(outs) == 12


def test_max_batch_limit():
    with pytest.raises(ValueError):
        Policy(max_batch=9)
    with pytest.raises(ValueError):
        Policy(max_batch=0)


def test_frame_encoded_once_and_shared_with_on_demand():
    s, eng, _, outs = make()
    s.submit_frame("cam", 7, img(person=3, cup=3), [("det", DET, 1.0), ("pt", PNT, 1.0)])
    s.submit_frame("cam", 7, None, [TaskSpec("ask", ASK, 1.0)], kind="on_demand")
    s.run_until_idle()
    assert eng.calls["encode"] == 1 and len(outs) == 3
    assert all(o.status is Status.DONE for o in outs)
    assert not s.frames                                     # the encoding is freed


def test_invalid_task_and_engine_errors_become_outcomes():
    s, eng, _, outs = make()
    s.submit_frame("cam", 0, img(), [("bad", Task("detect", object=""), 1.0)])
    assert outs[-1].status is Status.ERROR and "invalid task" in outs[-1].error

    def boom(runs):
        raise RuntimeError("gpu on fire")
    eng.step_batch = boom
    s.submit_frame("cam", 1, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    assert outs[-1].status is Status.ERROR and "gpu on fire" in outs[-1].error
    assert not eng.open_runs and s.metrics()["errors"] == 2


def test_callback_errors_do_not_stop_the_loop():
    s, _, _, outs = make()

    def bad(o):
        raise ValueError("user bug")
    s.submit_frame("cam", 0, img(person=2), [("det", DET, 1.0)], on_result=bad)
    s.run_until_idle()
    assert outs[0].status is Status.DONE and s.metrics()["callback_errors"] == 1


def test_metrics_counters_and_outcome_fields():
    s, _, _, outs = make()
    s.submit_frame("cam", 0, img(person=2), [("det", DET, 1.0)])
    s.submit_frame("cam", 1, img(person=2), [("det", DET, 1.0)])
    s.run_until_idle()
    m = s.metrics()
    assert m["submitted"] == 2 and m["done"] == 1 and m["superseded"] == 1
    assert m["per_stream"] == {"cam": {"submitted": 2, "processed": 1}}
    o = [x for x in outs if x.ok][0]
    assert o.timings["encode_ms"] == pytest.approx(10.0) and o.engine_ms > 0
    assert o.result.output == {"sim_steps": 2} and o.age_s > 0 and o.deadline == pytest.approx(1.0)


def test_project_and_cost_model():
    assert COST.step_ms(3) == pytest.approx(3.0)            # interpolated
    assert COST.step_ms(16) > COST.step_ms(8)               # extrapolated
    from photon_core.scheduler import Load
    fin = project(0.0, [Load(10, 1, (0,)), Load(5, 1, (1,))], 1, lambda b: 1.0)
    assert fin == [pytest.approx(0.010), pytest.approx(0.015)]
    fin = project(0.0, [Load(10, 1, (0,)), Load(5, 1, (1,))], 2, lambda b: 1.0 * b)
    assert fin == [pytest.approx(0.015), pytest.approx(0.010)]   # 5 steps of 2 ms, then 5 of 1 ms


def test_calibrate_recovers_the_simulated_costs():
    clock = VirtualClock()
    truth = CostModel(encode_base_ms=3.0, encode_per_crop_ms=2.0, prefill_base_ms=1.5,
                      prefill_per_token_ms=0.05, decode_step_ms={1: 3.0, 2: 3.3, 4: 4.0, 8: 5.5})
    eng = SimEngine(clock, truth, jitter=0.0)
    cm = CostModel.calibrate(eng, clock, make_image=lambda h, w: SimImage((h, w)))
    assert cm.encode_per_crop_ms == pytest.approx(2.0) and cm.encode_base_ms == pytest.approx(3.0)
    assert cm.prefill_per_token_ms == pytest.approx(0.05) and cm.prefill_base_ms == pytest.approx(1.5)
    assert cm.decode_step_ms == pytest.approx({1: 3.0, 2: 3.3, 4: 4.0, 8: 5.5})
    assert not eng.open_runs


def test_threaded_scheduler_never_loses_a_request():
    import time as _t

    from photon_core.scheduler.clock import MonotonicClock

    class SlowSim(SimEngine):          # wall-clock engine: sleeps instead of advancing time
        def _spend(self, ms):
            _t.sleep(ms / 1e3 * 0.1)
    eng = SlowSim(VirtualClock(), COST.scaled(1.0), jitter=0.0)
    outs, lock = [], threading.Lock()

    def cb(o):
        with lock:
            outs.append(o)
    ts = ThreadedScheduler(Scheduler(eng, COST.scaled(1.0), clock=MonotonicClock()))

    def producer(c):
        for k in range(30):
            ts.submit_frame(f"cam{c}", k, img(person=3), [("det", DET, 0.5)], on_result=cb)
            _t.sleep(0.001)
    th = [threading.Thread(target=producer, args=(c,)) for c in range(3)]
    [t.start() for t in th]
    [t.join() for t in th]
    ts.stop(drain=False)
    ts.submit_frame("late", 0, img(person=1), [("det", DET, 0.5)], on_result=cb)
    assert not ts.alive
    ids = [o.request_id for o in outs]
    assert len(outs) == 91 and len(set(ids)) == 91
    assert outs[-1].status is Status.CANCELLED and outs[-1].error == "scheduler stopped"
    assert {o.status for o in outs} <= {Status.DONE, Status.SUPERSEDED, Status.SKIPPED,
                                        Status.CANCELLED, Status.DEADLINE}
    assert not eng.open_runs


def test_threaded_drain_finishes_open_work():
    from photon_core.scheduler.clock import MonotonicClock
    eng = SimEngine(VirtualClock(), COST.scaled(1.0), jitter=0.0)
    outs = []
    ts = ThreadedScheduler(Scheduler(eng, COST.scaled(1.0), clock=MonotonicClock()))
    for c in range(4):
        ts.submit_frame(f"cam{c}", 0, img(person=3), [("det", DET, 5.0)], on_result=outs.append)
    ts.stop(drain=True)
    assert len(outs) == 4 and all(o.status is Status.DONE for o in outs)


def test_threaded_callbacks_may_call_back_in():
    """A callback (on the scheduler thread) may read metrics and submit more work."""
    from photon_core.scheduler.clock import MonotonicClock
    eng = SimEngine(VirtualClock(), COST.scaled(1.0), jitter=0.0)
    outs, seen = [], []
    ts = ThreadedScheduler(Scheduler(eng, COST.scaled(1.0), clock=MonotonicClock()))

    def cb(o):
        outs.append(o)
        seen.append(ts.metrics()["submitted"])
        if o.stamp < 3:
            ts.submit_frame("cam", o.stamp + 1, img(person=2), [("det", DET, 5.0)], on_result=cb)
    ts.submit_frame("cam", 0, img(person=2), [("det", DET, 5.0)], on_result=cb)
    import time as _t
    t_end = _t.monotonic() + 10
    while len(outs) < 4 and _t.monotonic() < t_end:
        _t.sleep(0.01)
    ts.stop()
    assert [o.stamp for o in outs] == [0, 1, 2, 3] and all(o.ok for o in outs)
    assert seen == [1, 2, 3, 4] and ts.error is None


def test_scheduler_drains_a_pipelined_engine_when_idle():
    s, eng, _, outs = make()
    drains = []
    eng.drain = lambda: drains.append(1)
    s.submit_frame("cam", 0, img(person=2), [("det", DET, 1.0)])
    s.run_until_idle()
    assert outs[0].ok and drains


# -- review regressions ------------------------------------------------------------------
class _WallSim(SimEngine):
    """Wall-clock engine: sleeps `slow` x the simulated cost instead of advancing time."""
    slow = 1.0

    def _spend(self, ms):
        import time as _t
        _t.sleep(ms / 1e3 * self.slow)


def test_threaded_submit_during_drain_is_answered_without_waiting():
    """A submission while stop(drain=True) runs is refused at once (CANCELLED from the
    scheduler thread), not after the drain: the submitting thread is a ROS callback."""
    import time as _t

    from photon_core.scheduler.clock import MonotonicClock
    eng = _WallSim(VirtualClock(), COST.scaled(1.0), jitter=0.0)
    eng.slow = 5.0                      # 60 steps x ~10 ms: the drain takes ~0.7 s
    outs, got_late = [], threading.Event()

    def cb(o):
        outs.append(o)
        if o.stream == "late":
            got_late.set()
    ts = ThreadedScheduler(Scheduler(eng, COST.scaled(1.0), clock=MonotonicClock()))
    for c in range(4):
        ts.submit_frame(f"cam{c}", 0, img(person=60), [("det", DET, 60.0)], on_result=cb)
    _t.sleep(0.1)
    stopper = threading.Thread(target=ts.stop, kwargs={"drain": True, "timeout": 30})
    stopper.start()
    _t.sleep(0.05)
    t0 = _t.monotonic()
    ts.submit_frame("late", 0, img(person=1), [("det", DET, 5.0)], on_result=cb)
    assert _t.monotonic() - t0 < 0.1            # the caller did not wait for the drain
    assert got_late.wait(0.3)                    # ... and was answered within a step or two
    late = [o for o in outs if o.stream == "late"]
    assert late[0].status is Status.CANCELLED and late[0].error == "scheduler stopped"
    assert ts.alive                              # still draining meanwhile
    stopper.join()
    assert not ts.alive and len(outs) == 5
    assert sorted(str(o.status) for o in outs) == ["cancelled"] + ["done"] * 4


def test_threaded_stop_from_a_callback_and_racing_submitters():
    """stop() may be called from a callback; submitters racing with stop() (and callbacks
    that raise) still get exactly one outcome per task request."""
    import time as _t

    from photon_core.scheduler.clock import MonotonicClock
    eng = _WallSim(VirtualClock(), COST.scaled(1.0), jitter=0.0)
    eng.slow = 0.2
    outs, lock = [], threading.Lock()
    ts = None

    def cb(o):
        with lock:
            outs.append(o)
            n = len(outs)
        if n == 20:
            ts.stop()                   # from the scheduler thread
        if n % 7 == 0:
            raise RuntimeError("broken callback")
    ts = ThreadedScheduler(Scheduler(eng, COST.scaled(1.0), clock=MonotonicClock()))
    submitted = [0] * 4

    def producer(c):
        for k in range(200):
            ts.submit_frame(f"cam{c}", k, img(person=2), [("det", DET, 0.5), ("pt", PNT, 0.5)],
                            on_result=cb)
            submitted[c] += 2
            _t.sleep(0.0005)
    th = [threading.Thread(target=producer, args=(c,)) for c in range(4)]
    [t.start() for t in th]
    [t.join() for t in th]
    ts.stop()
    assert not ts.alive and ts.error is None
    ids = [o.request_id for o in outs]
    assert len(ids) == sum(submitted) == 1600 and len(set(ids)) == len(ids)
    assert any(o.error == "scheduler stopped" for o in outs)
    assert ts.metrics()["callback_errors"] == len(outs) // 7
    assert not eng.open_runs


def test_callbacks_may_cancel_reentrantly():
    """A callback on the plain Scheduler that cancels other work must not end a request
    twice (it raised 'ended twice' from the decode loop)."""
    s, eng, clock, outs = make()

    def cb(o):
        if o.stream == "a":
            s.cancel()
    s.submit_frame("a", 0, img(person=4), [("d", DET, 1.0)], on_result=cb)
    s.submit_frame("b", 0, img(person=4), [("d", DET, 1.0)], on_result=cb)
    s.run_until_idle()
    st = {o.stream: o.status for o in outs}
    assert len(outs) == 2 and st == {"a": Status.DONE, "b": Status.CANCELLED}
    assert not eng.open_runs and not s.has_work()


def test_submit_failure_of_one_task_does_not_duplicate_the_others():
    """A task whose submission raises (here: stamps that do not compare) ends ERROR; the
    frame's other tasks are queued normally and each gets exactly one outcome."""
    s, eng, clock, outs = make()
    s.submit_frame("cam", 1, img(person=2), [("a", DET, 1.0)])
    s.submit_frame("cam", "x", img(person=2, cup=2), [("b", PNT, 1.0), ("a", DET, 1.0)])
    s.run_until_idle()
    got = sorted((o.stamp, o.task_name, str(o.status)) for o in outs if o.stamp == "x")
    assert got == [("x", "a", "error"), ("x", "b", "done")]
    assert len(outs) == 3 and s.metrics()["submitted"] == 3


class _SetupEngine(SimEngine):
    """The first encode of each image size also pays a one-time setup (like the fast path's
    graph capture for a new crop tiling) and reports it in setup_ms."""

    def __init__(self, clock, cost, setup_ms=400.0):
        super().__init__(clock, cost, jitter=0.0)
        self.setup_ms, self.seen = setup_ms, set()

    def encode_image(self, image):
        first = image.shape not in self.seen
        self.seen.add(image.shape)
        if first:
            self._spend(self.setup_ms)
        enc = super().encode_image(image)
        enc.setup_ms = self.setup_ms if first else 0.0
        return enc


def test_one_time_encode_setup_is_not_learned_as_cost():
    """The first frame of a camera pays a 400 ms one-time setup: the cost model learns the
    steady 10 ms, so the next frames (100 ms deadlines) are admitted, not skipped."""
    clock = VirtualClock()
    eng = _SetupEngine(clock, COST.scaled(1.0))
    outs: list[Outcome] = []
    s = Scheduler(eng, CostModel(0.0, 10.0, 1.0, 0.0, dict(COST.decode_step_ms), ema=0.1),
                  clock=clock, on_result=outs.append)
    for i in range(5):
        s.submit_frame("cam", i, img(person=4), [("det", DET, 0.1)])
        s.run_until_idle()
        clock.advance(0.1)
    assert s.cost.encode_seen[(300, 300)] == pytest.approx(10.0)
    assert [o.status for o in outs[1:]] == [Status.DONE] * 4


def test_calibrate_warms_up_every_image_size():
    """calibrate() with an engine that sets up once per size: the fitted encode costs are the
    steady ones (each size is encoded once untimed first)."""
    clock = VirtualClock()
    truth = CostModel(encode_base_ms=3.0, encode_per_crop_ms=2.0, prefill_base_ms=1.5,
                      prefill_per_token_ms=0.05, decode_step_ms={1: 3.0, 2: 3.3, 4: 4.0, 8: 5.5})
    eng = _SetupEngine(clock, truth)
    cm = CostModel.calibrate(eng, clock, make_image=lambda h, w: SimImage((h, w)))
    assert cm.encode_per_crop_ms == pytest.approx(2.0) and cm.encode_base_ms == pytest.approx(3.0)


def test_encode_probe_recovers_from_an_overestimate():
    """The scheduler believes a camera's frames cost 10 s to encode (really 10 ms), so every
    frame (100 ms deadline) is skipped; after probe_after_s it encodes one frame anyway,
    learns the real cost and answers the following frames. No task is started on the wrong
    estimate, so nothing admitted misses its deadline; with probes off (encode and task
    probes, test_scheduler_probe.py) the camera stays silent."""
    for probe in (2.0, 0.0):
        clock = VirtualClock()
        eng = SimEngine(clock, COST.scaled(1.0), jitter=0.0)
        outs: list[Outcome] = []
        cm = CostModel(0.0, 10.0, 1.0, 0.0, dict(COST.decode_step_ms), ema=0.1)
        cm.encode_seen[(300, 300)] = 10_000.0
        s = Scheduler(eng, cm, clock=clock,
                      policy=Policy(probe_after_s=probe, task_probe_after_s=probe),
                      on_result=outs.append)
        for i in range(40):                      # 4 s at 10 fps
            s.submit_frame("cam", i, img(person=4), [("det", DET, 0.1)])
            s.run_until_idle()
            clock.advance(0.1)
        done = [o for o in outs if o.status is Status.DONE]
        m = s.metrics()
        if probe:
            assert m["probes"] >= 1 and len(done) >= 15
            assert all(not o.missed_deadline for o in done)
            assert all(o.status is Status.SKIPPED for o in outs[:19])   # before the probe
        else:
            assert m["probes"] == 0 and not done and m["encodes"] == 0
