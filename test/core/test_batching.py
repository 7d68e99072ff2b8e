"""Batched decode and encode across cameras (issue 13): runs of different cameras and
several tasks of one frame share decode steps, join and leave a running batch between
steps; frames admitted together are encoded in one engine call when the engine offers it."""
from __future__ import annotations

from photon_core.scheduler import CostModel, Policy, Scheduler, Status, VirtualClock
from photon_core.scheduler.simulator import BatchEncodeSimEngine, SimEngine, SimImage
from photon_core.task import Task

COST = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 2: 2.2, 4: 2.5, 8: 3.0}, ema=0.1)
DET = Task("detect", object="person")
PNT = Task("point", object="cup")


def img(person=4, cup=4):
    return SimImage((300, 300), (("person", person), ("cup", cup)))


def recording(eng):
    """Wraps step_batch: records the (stream-tagged) runs of every step."""
    steps = []
    orig = eng.step_batch

    def rec(runs):
        steps.append([id(r) for r in runs])
        return orig(runs)
    eng.step_batch = rec
    return steps


def make(engine_cls=SimEngine, max_batch=4, **kw):
    clock = VirtualClock()
    eng = engine_cls(clock, COST.scaled(1.0), jitter=0.0, **kw)
    outs = []
    s = Scheduler(eng, COST.scaled(1.0), clock=clock, policy=Policy(max_batch=max_batch),
                  on_result=outs.append)
    return s, eng, clock, outs


def test_runs_of_different_cameras_and_tasks_join_a_running_batch():
    s, eng, clock, outs = make()
    steps = recording(eng)
    s.submit_frame("cam0", 0, img(person=12), [("det", DET, 1.0)])
    s.step()
    s.step()                                             # cam0 decoding alone
    assert len(steps[-1]) == 1
    s.submit_frame("cam1", 0, img(person=12, cup=12), [("det", DET, 1.0), ("pt", PNT, 1.0)])
    s.step()                                             # cam1's two tasks join between steps
    assert len(steps[-1]) == 3
    runs = {id(r.run): r for r in s.live}
    assert {runs[i].stream for i in steps[-1]} == {"cam0", "cam1"}
    s.run_until_idle()
    assert all(o.status is Status.DONE and not o.missed_deadline for o in outs) and len(outs) == 3
    # cam0 (2 steps ahead) leaves the batch first; cam1's two tasks finish at batch 2
    assert [len(x) for x in steps[2:]] == [3] * 10 + [2, 2]


def test_same_tick_frames_of_four_cameras_decode_in_one_batch():
    s, eng, clock, outs = make()
    for c in range(4):
        s.submit_frame(f"cam{c}", 0, img(person=7), [("det", DET, 1.0)], capture_time=0.0)
    s.run_until_idle()
    assert all(o.ok for o in outs) and len(outs) == 4
    assert s.metrics()["batch_sizes"] == {4: 7}          # every step: all four cameras


def test_batched_encode_of_frames_admitted_together():
    s, eng, clock, outs = make(BatchEncodeSimEngine, gain=0.3)
    for c in range(4):
        s.submit_frame(f"cam{c}", 0, img(person=7), [("det", DET, 1.0), ("pt", PNT, 1.0)],
                       capture_time=0.0)
    s.run_until_idle()
    assert all(o.ok for o in outs) and len(outs) == 8
    m = s.metrics()
    assert eng.calls["encode_batch"] >= 1 and m["encode_batches"]
    assert max(m["encode_batches"]) >= 2 and eng.calls["encode"] == 4   # each frame once
    assert m["encodes"] == 4


def test_batched_encode_only_while_the_group_fits():
    """Tight deadlines: the group stops growing where admission says the batched encode
    would make a member late; nothing admitted misses."""
    s, eng, clock, outs = make(BatchEncodeSimEngine, gain=0.0)
    for c in range(6):
        s.submit_frame(f"cam{c}", 0, img(person=4), [("det", DET, 0.08)], capture_time=0.0)
    s.run_until_idle()
    done = [o for o in outs if o.ok]
    assert done and all(not o.missed_deadline for o in done)
    assert len(outs) == 6 and {o.status for o in outs} <= {Status.DONE, Status.SKIPPED}
    # one frame alone fits with room for a second; a third would make the group late
    assert max(s.metrics()["encode_batches"]) == 2


def test_batched_encode_learns_its_cost():
    cm = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, ema=0.5)
    ims = [SimImage((300, 300))] * 4
    assert cm.encode_batch_ms(ims) == 40.0                 # no gain assumed before a measurement
    cm.observe_encode_batch(ims, 24.0)
    assert cm.batch_factor(4) == 0.6 and cm.encode_batch_ms(ims) == 24.0
    assert cm.batch_factor(8) == 0.6 and cm.batch_factor(2) == 1.0
    cm.observe_step(4, 20.0)                               # decode step cost per batch size
    assert abs(cm.step_ms(4) - 20.0) < 1e-9 and 4 in cm.f_step_b and 2 not in cm.f_step_b
