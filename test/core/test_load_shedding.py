"""GPU out of memory in a big batch (issue 17): the scheduler sheds load (smaller batches for
a while), retries, recovers; an engine exception on one request leaves the others alone."""
from __future__ import annotations

from photon_core.scheduler import CostModel, Policy, Scheduler, Status, VirtualClock
from photon_core.scheduler.load_shedding import BatchLimiter, is_out_of_memory
from photon_core.scheduler.simulator import SimEngine, SimImage
from photon_core.task import Task

COST = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5}, ema=0.0)
DET = Task("detect", object="person")
PNT = Task("point", object="cup")


class OutOfMemoryError(RuntimeError):        # what torch.cuda.OutOfMemoryError is named
    pass


class OOMEngine(SimEngine):
    """Raises (before touching any run) when a step has more than `room` runs, while
    `oom_until` (clock time) has not passed."""

    def __init__(self, clock, cost, room=2, oom_until=float("inf"), start_room=None):
        super().__init__(clock, cost, jitter=0.0)
        self.room, self.oom_until, self.start_room = room, oom_until, start_room
        self.sizes = []

    def step_batch(self, runs):
        if len(runs) > self.room and self.clock.now() < self.oom_until:
            self.clock.advance(0.001)
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.sizes.append(len(runs))
        return super().step_batch(runs)

    def start(self, enc, task):
        if self.start_room is not None and len(self.open_runs) >= self.start_room:
            raise OutOfMemoryError("CUDA out of memory (prefill)")
        return super().start(enc, task)


def make(engine_kw=None, **policy):
    clock = VirtualClock()
    eng = OOMEngine(clock, COST.scaled(1.0), **(engine_kw or {}))
    outs = []
    s = Scheduler(eng, COST.scaled(1.0), clock=clock, policy=Policy(**policy), on_result=outs.append)
    return s, eng, clock, outs


def img(n):
    return SimImage((300, 300), (("person", n), ("cup", n)))


def test_oom_above_a_batch_size_sheds_and_everything_is_answered():
    s, eng, clock, outs = make({"room": 2}, max_batch=4)
    for c in range(6):
        s.submit_frame(f"cam{c}", 0, img(8), [("det", DET, 10.0)])
    s.run_until_idle()
    assert len(outs) == 6 and all(o.status is Status.DONE for o in outs), [o.error for o in outs]
    m = s.metrics()
    assert m["sheds"] >= 1 and s.limiter.ooms >= 1
    assert max(eng.sizes) <= 2                     # after the first failure: never above room
    assert not eng.open_runs and not s.frames


def test_the_batch_limit_recovers_after_the_hold():
    s, eng, clock, outs = make({"room": 1, "oom_until": 1.0}, max_batch=4, shed_hold_s=2.0)
    for c in range(4):
        s.submit_frame(f"cam{c}", 0, img(20), [("det", DET, 60.0)])
    s.run_until_idle()
    assert all(o.status is Status.DONE for o in outs) and max(eng.sizes) == 1
    assert s.metrics()["batch_limit"] == 1         # still held (the run took < 2 s)
    clock.advance(5.0)                             # the memory is back; hold passed
    for c in range(4):
        s.submit_frame(f"cam{c}", 1, img(20), [("det", DET, 60.0)])
    s.run_until_idle()
    assert max(eng.sizes[-20:]) == 4 and s.metrics()["batch_limit"] == 4
    assert all(o.status is Status.DONE for o in outs) and len(outs) == 8


def test_oom_at_start_with_runs_open_retries_the_request():
    s, eng, clock, outs = make({"room": 8, "start_room": 2}, max_batch=4)
    for c in range(4):
        s.submit_frame(f"cam{c}", 0, img(6), [("det", DET, 10.0)])
    s.run_until_idle()
    assert len(outs) == 4 and all(o.status is Status.DONE for o in outs), [o.error for o in outs]
    assert s.metrics()["sheds"] >= 1 and max(eng.sizes) <= 2


def test_an_exception_on_one_request_leaves_the_others_unaffected():
    clock = VirtualClock()
    eng = SimEngine(clock, COST.scaled(1.0), jitter=0.0)
    orig = eng.step_batch

    def poisoned(runs):
        if any(r.task.target == "cup" for r in runs):
            raise ValueError("bad request")
        return orig(runs)
    eng.step_batch = poisoned
    outs = []
    s = Scheduler(eng, COST.scaled(1.0), clock=clock, policy=Policy(max_batch=4),
                  on_result=outs.append)
    s.submit_frame("a", 0, img(5), [("det", DET, 10.0), ("pt", PNT, 10.0)])
    s.submit_frame("b", 0, img(5), [("det", DET, 10.0)])
    s.submit_frame("c", 0, img(5), [("det", DET, 10.0)])
    s.run_until_idle()
    st = {(o.stream, o.task_name): o.status for o in outs}
    assert st == {("a", "det"): Status.DONE, ("a", "pt"): Status.ERROR, ("b", "det"): Status.DONE,
                  ("c", "det"): Status.DONE}
    assert "bad request" in [o for o in outs if o.status is Status.ERROR][0].error
    assert not eng.open_runs and not s.has_work()


def test_an_engine_that_always_fails_ends_every_request_in_error():
    s, eng, clock, outs = make({"room": 0}, max_batch=4)
    for c in range(5):
        s.submit_frame(f"cam{c}", 0, img(3), [("det", DET, 10.0)])
    s.run_until_idle()
    assert len(outs) == 5 and all(o.status is Status.ERROR for o in outs)
    assert "out of memory" in outs[0].error and not s.has_work()


def test_batch_limiter_rules():
    lim = BatchLimiter(8, hold_s=1.0)
    assert lim.limit(0.0) == 8
    assert lim.shed(3, 0.0, OutOfMemoryError("x")) == 3 and lim.limit(0.5) == 3
    assert lim.limit(1.0) == 6 and lim.limit(1.5) == 6 and lim.limit(2.0) == 8
    assert lim.sheds == 1 and lim.ooms == 1
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried")) and not is_out_of_memory(ValueError("x"))
