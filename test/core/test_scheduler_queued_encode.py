"""Queued encodes (photon_core/scheduler/queued_encode.py): an engine declaring
queued_encode is asked to encode with sync=False; the frame's tasks start before the
encode's device time is read, and the cost model, the frames' encode_ms and the outcomes get
that device time (not the host's queueing time). Other engines keep the synchronous
sequence. No CUDA: the encodings carry fake events (synchronize / elapsed_time) on the
virtual clock."""
from __future__ import annotations

import dataclasses

import pytest

from photon_core.engine import PrefixState
from photon_core.scheduler import CostModel, Policy, Scheduler, Status, VirtualClock
from photon_core.scheduler.engine import encodes_queued
from photon_core.scheduler.simulator import SimEnc, SimEngine, SimImage
from photon_core.task import Task

# 10 ms encode (1 crop), 1 ms prefill, 2 ms per decode step
COST = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5}, ema=0.0)
DET = Task("detect", object="person")
PNT = Task("point", object="cup")
HOST_MS = 0.5          # the host's time of a queued encode call
GPU_MS = 7.0           # the device's time of one frame's encode (cost model starts at 10)


def img(**steps):
    return SimImage((300, 300), tuple(steps.items()))


class _Event:
    """A CUDA event on the virtual clock: `at` is when the device reaches it."""

    def __init__(self, log, clock, at, fail=False):
        self.log, self.clock, self.at, self.fail = log, clock, at, fail

    def synchronize(self):
        self.log.append(("sync",))
        if self.fail:
            raise RuntimeError("event failed")
        if self.clock.now() < self.at:      # the host waits for the device
            self.clock.advance_to(self.at)

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


@dataclasses.dataclass
class _QEnc(SimEnc):
    encode_ms: float = 0.0
    setup_ms: float = 0.0
    gpu_timing: object = None
    gpu_encode_ms = PrefixState.gpu_encode_ms      # the real contract's reader


class _SpyCost(CostModel):
    log: list = None

    def observe_encode(self, image, ms):
        self.log.append(("observe_encode", round(ms, 6)))
        super().observe_encode(image, ms)

    def observe_encode_batch(self, images, ms):
        self.log.append(("observe_encode_batch", len(images), round(ms, 6)))
        super().observe_encode_batch(images, ms)


class _QueuedSim(SimEngine):
    """Encodes queued on a fake device: the call takes HOST_MS of the clock, the encode ends
    GPU_MS (x the batch factor) after the call began; start() logs its order."""

    queued_encode = True

    def __init__(self, clock, log, setup_ms=0.0, fail_event=False, batch_factor=0.8,
                 gpu_ms=GPU_MS):
        super().__init__(clock, COST.scaled(1.0), jitter=0.0)
        self.log, self.setup_ms, self.fail_event = log, setup_ms, fail_event
        self.gpu_ms = gpu_ms
        self.batch_factor = batch_factor
        self.raise_next = False

    def _queued(self, images, gpu_ms):
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("encode failed")
        t0 = self.clock.now()
        self.clock.advance(HOST_MS / 1e3)
        timing = (_Event(self.log, self.clock, t0),
                  _Event(self.log, self.clock, t0 + gpu_ms / 1e3, self.fail_event),
                  1.0 / len(images))
        return [_QEnc(im, 1, encode_ms=HOST_MS / len(images),
                      setup_ms=self.setup_ms / len(images), gpu_timing=timing) for im in images]

    def encode_image(self, image, sync=True):
        self.log.append(("encode", sync))
        if sync:
            return super().encode_image(image)
        return self._queued([image], self.gpu_ms)[0]

    def start(self, enc, task):
        self.log.append(("start", task.target))
        return super().start(enc, task)


class _QueuedBatchSim(_QueuedSim):
    def encode_batch(self, images, sync=True):
        self.log.append(("encode_batch", sync, len(images)))
        assert not sync
        return self._queued(images, self.gpu_ms * self.batch_factor * len(images))


class _PlainSim(SimEngine):
    """No queued_encode: encode_image has no sync parameter (a call with one would raise)."""

    def __init__(self, clock, log):
        super().__init__(clock, COST.scaled(1.0), jitter=0.0)
        self.log = log

    def encode_image(self, image):
        self.log.append(("encode",))
        return super().encode_image(image)

    def start(self, enc, task):
        self.log.append(("start", task.target))
        return super().start(enc, task)


def make(engine_cls, **kw):
    clock, log, outs = VirtualClock(), [], []
    eng = engine_cls(clock, log, **kw)
    cost = _SpyCost(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                    prefill_per_token_ms=0.0, decode_step_ms=dict(COST.decode_step_ms),
                    ema=0.1)                        # COST's, learning
    cost.log = log
    s = Scheduler(eng, cost, clock=clock, policy=Policy(max_batch=4), on_result=outs.append)
    return s, eng, log, outs


def test_the_capability_is_an_explicit_flag():
    class Mocky:                    # a mock's auto-attributes are not a declaration
        def __getattr__(self, name):
            return object()
    assert encodes_queued(_QueuedSim(VirtualClock(), []))
    assert not encodes_queued(SimEngine(VirtualClock(), COST))
    assert not encodes_queued(Mocky())


def test_task_starts_before_the_encode_cost_is_read_and_the_model_learns_device_time():
    s, eng, log, outs = make(_QueuedSim)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode", "start", "sync", "observe_encode")]
    assert seq == [("encode", False), ("start", "person"), ("sync",),
                   ("observe_encode", GPU_MS)]
    assert s.cost.encode_seen[(300, 300)] == pytest.approx(GPU_MS)   # not HOST_MS
    (o,) = outs
    assert o.status is Status.DONE
    assert o.timings["encode_ms"] == pytest.approx(GPU_MS)
    assert s.metrics()["engine_ms"]["encode"] == pytest.approx(GPU_MS)
    assert s.metrics()["encode_calls"] == 1 and s.metrics()["encodes"] == 1
    assert not s._pending


def test_the_frames_tasks_share_the_queued_encode_and_the_setup_is_left_out():
    s, eng, log, outs = make(_QueuedSim, setup_ms=3.0)
    s.submit_frame("cam", 0, img(person=3, cup=2), [("det", DET, 1.0), ("pt", PNT, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode", "start", "sync", "observe_encode")]
    # the first task is started before the wait; the next decision is made measured
    assert seq[:4] == [("encode", False), ("start", "person"), ("sync",),
                       ("observe_encode", GPU_MS - 3.0)]
    assert ("start", "cup") in seq[4:] and seq.count(("encode", False)) == 1
    assert [o.status for o in outs] == [Status.DONE, Status.DONE]
    assert all(o.timings["encode_ms"] == pytest.approx(GPU_MS) for o in outs)
    assert s.cost.encode_seen[(300, 300)] == pytest.approx(GPU_MS - 3.0)


def test_batched_queued_encode_starts_the_group_then_learns_the_device_time():
    s, eng, log, outs = make(_QueuedBatchSim)
    for cam in ("a", "b", "c"):
        s.submit_frame(cam, 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode_batch", "encode", "start", "sync",
                                      "observe_encode_batch", "observe_encode")]
    n = seq[0][2]
    assert seq[0][:2] == ("encode_batch", False) and n >= 2
    assert seq[1:1 + n] == [("start", "person")] * n          # every start before any wait
    first_sync = seq.index(("sync",))
    assert first_sync == 1 + n
    total = GPU_MS * eng.batch_factor * n
    assert ("observe_encode_batch", n, pytest.approx(total)) in seq
    assert s.metrics()["encode_batches"] == {n: 1}
    got = sorted(o.timings["encode_ms"] for o in outs)[:n]
    assert got == pytest.approx([total / n] * n)               # each frame's share
    assert all(o.status is Status.DONE for o in outs) and len(outs) == 3


def test_an_engine_without_the_flag_keeps_the_synchronous_sequence():
    s, eng, log, outs = make(_PlainSim)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode", "start", "observe_encode")]
    assert seq == [("encode",), ("observe_encode", 10.0), ("start", "person")]
    assert outs[0].status is Status.DONE and outs[0].timings["encode_ms"] == pytest.approx(10.0)


def test_an_engine_taking_sync_but_not_declaring_it_is_called_as_before():
    class Undeclared(_QueuedSim):
        queued_encode = None
    s, eng, log, outs = make(Undeclared)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode", "start", "sync", "observe_encode")]
    assert seq == [("encode", True), ("observe_encode", 10.0), ("start", "person")]


def test_a_queued_encode_that_raises_ends_the_request_as_before():
    """As the synchronous encode's failure: the request ends ERROR (nothing else running),
    nothing is measured, the next frame is served."""
    for cls in (_QueuedSim, _PlainSim):
        s, eng, log, outs = make(cls)
        if cls is _QueuedSim:
            eng.raise_next = True
        else:
            def boom(image):
                raise RuntimeError("encode failed")
            eng.encode_image = boom
        s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
        s.run_until_idle()
        assert outs[0].status is Status.ERROR and "encode failed" in outs[0].error
        assert not [e for e in log if e[0].startswith("observe")]
        assert s.metrics()["engine_ms"]["encode"] == 0.0 and not s._pending
        if cls is _PlainSim:
            del eng.encode_image
        s.submit_frame("cam", 1, img(person=3), [("det", DET, 1.0)])
        s.run_until_idle()
        assert outs[1].status is Status.DONE


def test_a_failed_device_time_read_falls_back_to_the_host_time():
    s, eng, log, outs = make(_QueuedSim, fail_event=True)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    assert outs[0].status is Status.DONE
    assert s.metrics()["encode_timing_errors"] == 1
    assert ("observe_encode", HOST_MS) in log
    assert outs[0].timings["encode_ms"] == pytest.approx(HOST_MS)


def test_an_encode_probe_measures_the_device_time_at_once():
    """test_scheduler.py's probe scenario on a queued engine: the probe's encode is read at
    once (the decision after it needs it) and teaches the device time."""
    clock, log, outs = VirtualClock(), [], []
    eng = _QueuedSim(clock, log)
    cm = CostModel(0.0, 10.0, 1.0, 0.0, dict(COST.decode_step_ms), ema=0.1)
    cm.encode_seen[(300, 300)] = 10_000.0
    s = Scheduler(eng, cm, clock=clock, policy=Policy(probe_after_s=2.0), on_result=outs.append)
    for i in range(40):
        s.submit_frame("cam", i, img(person=4), [("det", DET, 0.1)])
        s.run_until_idle()
        clock.advance(0.1)
    assert s.metrics()["probes"] >= 1
    assert s.cost.encode_seen[(300, 300)] == pytest.approx(GPU_MS)
    done = [o for o in outs if o.status is Status.DONE]
    assert done and all(o.timings["encode_ms"] == pytest.approx(GPU_MS) for o in done)
    assert not any(o.missed_deadline for o in done)


def test_an_outcome_ended_before_the_settle_carries_the_device_time():
    """A run that ends at its start (finished before any step) is delivered inside the
    admission round: its outcome still has the encode's device time."""
    class EndsAtStart(_QueuedSim):
        def start(self, enc, task):
            run = super().start(enc, task)
            run._close("stop")
            return run
    s, eng, log, outs = make(EndsAtStart)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    (o,) = outs
    assert o.status is Status.DONE and o.timings["encode_ms"] == pytest.approx(GPU_MS)
    assert s.cost.encode_seen[(300, 300)] == pytest.approx(GPU_MS)


def test_outcomes_match_the_synchronous_engine_when_device_time_equals_the_model():
    """Same trace, a queued engine whose device time is the synchronous one's (10 ms): the
    same statuses and the same learned encode cost (only when the cost is read differs)."""
    def run(cls, **kw):
        s, eng, log, outs = make(cls, **kw)
        for k in range(6):
            for cam in ("a", "b"):
                s.submit_frame(cam, k, img(person=2 + k % 3, cup=2),
                               [("det", DET, 0.2), ("pt", PNT, 0.2)])
            s.step()
            s.clock.advance(0.01)
        s.run_until_idle()
        return (sorted((o.stream, o.stamp, o.task_name, o.status.value) for o in outs),
                s.cost.encode_seen[(300, 300)])
    queued, plain = run(_QueuedSim, gpu_ms=10.0), run(_PlainSim)
    assert queued[0] == plain[0] and queued[1] == pytest.approx(plain[1]) == pytest.approx(10.0)


def test_the_nodes_adapter_forwards_the_flag_and_sync():
    """photon_ros' HookedEngine (the live node's engine): queued where the model is, with
    the same call sequence; a model without the flag is called as before."""
    adapter = pytest.importorskip("photon_ros.engine_adapter")   # no ROS imports in it
    clock, log, outs = VirtualClock(), [], []
    model = _QueuedBatchSim(clock, log)
    model.capabilities = None                  # (the adapter forwards the family's)
    eng = adapter.HookedEngine(model)
    assert eng.queued_encode is True and callable(eng.encode_batch)
    s = Scheduler(eng, CostModel(ema=0.1), clock=clock, on_result=outs.append)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    seq = [e for e in log if e[0] in ("encode", "start", "sync")]
    assert seq == [("encode", False), ("start", "person"), ("sync",)]
    assert outs[0].timings["encode_ms"] == pytest.approx(GPU_MS)
    log.clear()
    model = _PlainSim(clock, log)
    model.capabilities = None
    plain = adapter.HookedEngine(model)
    assert plain.queued_encode is False
    s = Scheduler(plain, CostModel(ema=0.1), clock=clock)
    s.submit_frame("cam", 0, img(person=3), [("det", DET, 1.0)])
    s.run_until_idle()
    assert [e for e in log if e[0] in ("encode", "start")] == [("encode",), ("start", "person")]
