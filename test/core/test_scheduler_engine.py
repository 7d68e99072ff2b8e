"""End to end: the scheduler drives the Moondream reference engine (tiny random model, CPU)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("photon_core.moondream")

from photon_core.scheduler import (CostModel, MonotonicClock, Scheduler, Status, TaskSpec,  # noqa: E402
                                   ThreadedScheduler)
from photon_core.task import Task  # noqa: E402

DET = Task("detect", object="person", max_objects=3)
PNT = Task("point", object="cup", max_objects=3)
ASK = Task("query", question="What is this?", max_tokens=8)


@pytest.fixture(scope="module")
def frames():
    rng = np.random.default_rng(5)
    return {(s, k): rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for s in ("a", "b") for k in range(3)}


@pytest.fixture(scope="module")
def cost(fast_model):
    return CostModel.calibrate(fast_model, image_sizes=((96, 128), (300, 500)), batch_sizes=(1, 2, 4),
                               steps=2, repeats=1)


def test_calibrate_on_the_engine(cost):
    assert cost.encode_ms(shape=(96, 128)) > 0 and cost.prefill_ms(10) > 0
    assert set(cost.decode_step_ms) == {1, 2, 4} and all(v > 0 for v in cost.decode_step_ms.values())


def test_scheduler_drives_the_engine(fast_model, cost, frames):
    outs = []
    s = Scheduler(fast_model, cost, on_result=outs.append, max_batch=4)
    for k in range(3):                                   # 3 frames per stream queue up at once
        for stream in ("a", "b"):
            s.submit_frame(stream, float(k), frames[(stream, k)],
                           [("person", DET, 30.0), ("cup", PNT, 30.0, "finish")])
    s.submit_frame("a", 2.0, None, [TaskSpec("ask", ASK, 30.0, "finish")], kind="on_demand")
    s.run_until_idle()
    assert len(outs) == 13
    done = [o for o in outs if o.status is Status.DONE]
    sup = [o for o in outs if o.status is Status.SUPERSEDED]
    assert len(sup) == 8 and all(o.stamp < 2.0 for o in sup)          # latest frame wins
    assert len(done) == 5 and all(o.stamp == 2.0 for o in done)
    assert s.metrics()["encodes"] == 2                                 # once per frame, shared
    for o in done:                                                     # same answers as model.run
        task = {"person": DET, "cup": PNT, "ask": ASK}[o.task_name]
        ref = fast_model.run(fast_model.encode_image(frames[(o.stream, 2)]), task)
        assert o.result.output == ref.output and o.result.tokens == ref.tokens == o.steps
        assert o.engine_ms > 0 and o.timings["encode_ms"] > 0
    assert set(done[0].result.output) <= {"objects", "points", "answer"}
    assert not s.frames and not s.has_work()


def test_cancel_a_running_engine_task(fast_model, cost, frames):
    outs = []
    s = Scheduler(fast_model, cost, on_result=outs.append)
    long_q = Task("query", question="Describe everything.", max_tokens=200, temperature=0.0)
    (rid,) = s.submit_frame("a", 0.0, frames[("a", 0)], [("long", long_q, 60.0, "finish")])
    s.step()
    s.step()
    assert s.live and s.cancel(rid) == 1
    (o,) = outs
    assert o.status is Status.CANCELLED
    if o.result is not None:                 # the run was still going when cancelled
        assert o.result.finish_reason in ("cancelled", "stop", "length")
    assert not s.frames and not s.live


def test_hopeless_deadline_is_skipped_not_started(fast_model, cost, frames):
    outs = []
    s = Scheduler(fast_model, cost, on_result=outs.append)
    s.submit_frame("a", 0.0, frames[("a", 0)], [("person", DET, 1e-6)])
    s.run_until_idle()
    assert outs[0].status is Status.SKIPPED and s.metrics()["encodes"] == 0


def test_threaded_scheduler_with_the_engine(fast_model, cost, frames):
    outs, lock = [], threading.Lock()

    def cb(o):
        with lock:
            outs.append(o)
    ts = ThreadedScheduler(Scheduler(fast_model, cost, clock=MonotonicClock()))

    def cam(stream):
        for k in range(3):
            ts.submit_frame(stream, float(k), frames[(stream, k)], [("person", DET, 30.0)], on_result=cb)
    th = [threading.Thread(target=cam, args=(s,)) for s in ("a", "b")]
    [t.start() for t in th]
    [t.join() for t in th]
    ts.stop(drain=True, timeout=120)
    assert not ts.alive and len(outs) == 6
    assert {o.status for o in outs} <= {Status.DONE, Status.SUPERSEDED}
    latest = {o.stream: o.stamp for o in outs if o.ok}
    assert latest == {"a": 2.0, "b": 2.0}


@pytest.fixture(scope="module")
def fast_engine(fast_model):
    fast = pytest.importorskip("photon_core.fast")
    return fast.FastEngine(fast_model, max_batch=4, warmup=False)


def test_scheduler_drives_the_fast_path_engine(fast_engine, fast_model, frames):
    """The fast path (on the CPU: same pipeline, no graphs) behind the same protocol; its
    4 KV rows cap the scheduler (max_batch 4, no extra on-demand rows)."""
    cost = CostModel.calibrate(fast_engine, image_sizes=((96, 128), (300, 500)),
                               batch_sizes=(1, 2, 4, 8), steps=2, repeats=1)
    assert set(cost.decode_step_ms) == {1, 2, 4}
    outs = []
    s = Scheduler(fast_engine, cost, on_result=outs.append, max_batch=8)
    assert s.policy.max_batch == 4 and s.policy.max_extra == 0
    for k in range(3):
        for stream in ("a", "b"):
            s.submit_frame(stream, float(k), frames[(stream, k)],
                           [("person", DET, 60.0), ("cup", PNT, 60.0, "finish"),
                            ("ask", ASK, 60.0, "finish")])
    s.run_until_idle()
    done = [o for o in outs if o.status is Status.DONE]
    assert len(outs) == 18 and len(done) == 6 and all(o.stamp == 2.0 for o in done)
    for o in done:                                        # same answers as the reference path
        task = {"person": DET, "cup": PNT, "ask": ASK}[o.task_name]
        ref = fast_model.run(fast_model.encode_image(frames[(o.stream, 2)]), task)
        assert o.result.output == ref.output
    assert fast_engine.rows.free_rows() == [0, 1, 2, 3]   # every row back


def test_decode_batches_across_cameras_on_the_engine(fast_model, cost, frames):
    """Frames of two cameras (two tasks each) share decode steps on the reference engine
    (step_batch over runs of different cameras and frames); answers equal model.run's."""
    outs, mixed = [], []
    s = Scheduler(fast_model, cost, on_result=outs.append, max_batch=4)
    orig = fast_model.step_batch

    def rec(runs):
        live = {id(r.run): r.stream for r in s.live}
        mixed.append(len({live.get(id(x)) for x in runs}))
        return orig(runs)
    fast_model.step_batch = rec
    try:
        for stream in ("a", "b"):
            s.submit_frame(stream, 0.0, frames[(stream, 0)],
                           [("person", DET, 60.0), ("cup", PNT, 60.0, "finish")])
        s.run_until_idle()
    finally:
        del fast_model.step_batch
    assert len(outs) == 4 and all(o.status is Status.DONE for o in outs)
    assert max(s.metrics()["batch_sizes"]) >= 3 and max(mixed) == 2     # both cameras in one step
    for o in outs:
        task = {"person": DET, "cup": PNT}[o.task_name]
        ref = fast_model.run(fast_model.encode_image(frames[(o.stream, 0)]), task)
        assert o.result.output == ref.output
