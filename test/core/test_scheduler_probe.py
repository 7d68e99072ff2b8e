"""The scheduler recovers from a calibration that ran slow (task probes + the cost model
decaying toward fresh measurements), on the simulator's engine (virtual clock).

Seen in CI: calibration took 15-20 s under load, admission judged every task hopeless and
skipped it, skipped tasks teach the cost model nothing, and the node served nothing for good.
"""
from __future__ import annotations

import pytest

from photon_core.scheduler import (CostModel, Outcome, Policy, Scheduler, Status,
                                   VirtualClock)
from photon_core.scheduler.simulator import SimEngine, SimImage
from photon_core.task import Task

# the engine's real costs: 10 ms encode (1 crop), ~1.5 ms prefill, 2 ms per decode step
TRUE = CostModel(encode_base_ms=0.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                 prefill_per_token_ms=0.05, decode_step_ms={1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5},
                 ema=0.0)
DET = Task("detect", object="person")
PNT = Task("point", object="cup")
SHAPE = (300, 300)


def img():
    return SimImage(SHAPE, (("person", 5), ("cup", 3)))


def slow_calibration(clock, factor=20.0) -> CostModel:
    """CostModel.calibrate on an engine `factor` x slower than the one that will serve."""
    slow = SimEngine(clock, TRUE.scaled(factor), jitter=0.0)
    return CostModel.calibrate(slow, clock, image_sizes=(SHAPE, (600, 600)),
                               make_image=lambda h, w: SimImage((h, w), (("Why?", 4),)))


def feed(policy: Policy, seconds: float = 8.0, on_miss: str = "cancel", cameras=("a", "b"),
         fps: float = 10.0, deadline_s: float = 0.15):
    clock = VirtualClock()
    cm = slow_calibration(clock)
    clock.advance(1.0)
    eng = SimEngine(clock, TRUE.scaled(1.0), jitter=0.05, seed=1)
    outs: list[Outcome] = []
    s = Scheduler(eng, cm, clock=clock, policy=policy, on_result=outs.append)
    t0 = clock.now()
    k = 0
    while clock.now() - t0 < seconds:
        tick = t0 + k / fps
        if clock.now() < tick:
            clock.advance(tick - clock.now())
        for cam in cameras:
            s.submit_frame(cam, k, img(), [("det", DET, deadline_s, on_miss),
                                           ("pt", PNT, deadline_s, on_miss)])
        s.run_until_idle()
        k += 1
    return s, outs, t0


def test_inflated_calibration_really_silences_admission():
    """The premise: with costs 20x too high every frame is hopeless for a 150 ms deadline."""
    clock = VirtualClock()
    cm = slow_calibration(clock)
    est = cm.encode_ms(shape=SHAPE) + cm.prefill_ms(10) + 5 * cm.step_ms(1)
    real = TRUE.encode_ms(shape=SHAPE) + TRUE.prefill_ms(10) + 5 * TRUE.step_ms(1)
    assert est == pytest.approx(20 * real, rel=0.05) and est > 150


@pytest.mark.parametrize("on_miss", ["cancel", "finish"])
def test_results_resume_after_a_slow_calibration(on_miss):
    s, outs, t0 = feed(Policy(), on_miss=on_miss)
    m = s.metrics()
    done = [o for o in outs if o.status is Status.DONE]
    assert done, m
    first = min(o.end_time for o in done) - t0
    assert first < 4.0, f"first result after {first:.1f} s"
    for cam in ("a", "b"):                     # every camera is served again, on time
        late_part = [o for o in outs if o.stream == cam and o.capture_time - t0 >= 5.0]
        ok = [o for o in late_part if o.status is Status.DONE and not o.missed_deadline]
        assert len(ok) >= 0.8 * len(late_part), (cam, [o.status.value for o in late_part])
    assert m["task_probes"] >= 1
    # probes are rare: a few at the start, none once the estimates are right
    assert m["task_probes"] <= 8, m["task_probes"]
    assert sum(o.probe for o in outs) == m["task_probes"]
    assert not [o for o in outs if o.probe and o.capture_time - t0 >= 5.0]


def test_without_task_probes_the_scheduler_stays_silent():
    """The same run with task probes off (the old behaviour): the encode probe alone does not
    get any result out, because the prefill and decode estimates never get a measurement."""
    s, outs, _ = feed(Policy(task_probe_after_s=0.0), seconds=6.0)
    assert not [o for o in outs if o.status is Status.DONE]
    assert s.metrics()["task_probes"] == 0 and s.metrics()["probes"] >= 1


def test_probes_are_bounded_when_the_engine_really_is_too_slow():
    """An engine that really is too slow for the deadlines (calibration was right): probes
    run only while nothing else runs, one stream at a time, at most a bounded share of the
    engine's time; everything else is skipped as before."""
    clock = VirtualClock()
    eng = SimEngine(clock, TRUE.scaled(20.0), jitter=0.0)
    cm = CostModel.calibrate(eng, clock, image_sizes=(SHAPE, (600, 600)),
                             make_image=lambda h, w: SimImage((h, w), (("Why?", 4),)))
    outs: list[Outcome] = []
    s = Scheduler(eng, cm, clock=clock, on_result=outs.append)
    t0 = clock.now()
    for k in range(200):                       # 20 s at 10 fps, 4 cameras
        tick = t0 + k / 10
        if clock.now() < tick:
            clock.advance(tick - clock.now())
        for cam in "abcd":
            s.submit_frame(cam, k, img(), [("det", DET, 0.15, "finish")])
        s.run_until_idle()
    m = s.metrics()
    assert 1 <= m["task_probes"] <= 20 * 4 / 2   # at most one per stream per 2 s
    # probes took at most ~ the allowed share of the engine's time (+ one probe's length);
    # the encode probes' encodes (no task started) aside
    busy = (m["engine_ms"]["prefill"] + m["engine_ms"]["decode"]) / 1e3 \
        + m["engine_ms"]["encode"] / 1e3 * m["task_probes"] / max(1, m["encodes"])
    assert 0 < busy <= Policy().task_probe_share * 20.0 + 0.6, busy
    assert m["done"] == m["task_probes"] and m["skipped"] == m["submitted"] - m["done"]


def test_cost_model_decays_toward_a_much_cheaper_measurement():
    cm = CostModel(decode_step_ms={1: 40.0}, prefill_base_ms=20.0, prefill_per_token_ms=0.0)
    for _ in range(3):
        cm.observe_step(1, 2.0)
        cm.observe_prefill(10, 1.0)
    assert cm.step_ms(1) < 4.0                  # the old clamp kept it >= 8 ms forever
    assert cm.prefill_ms(10) < 4.0
    # an ordinary noisy measurement still moves it by the usual small rate
    cm2 = CostModel(decode_step_ms={1: 10.0})
    cm2.observe_step(1, 10.0)
    cm2.observe_step(1, 9.0)
    assert cm2.step_ms(1) == pytest.approx(9.9, abs=0.05)
    cm2.observe_step(1, 200.0)                  # a slow outlier moves it only a little
    assert cm2.step_ms(1) < 15.0


# -- encode costs and probes are keyed by (size, crop mode) --------------------------------
BIG = (480, 640)             # 5 crops by the scheduler's estimate (1 with crops="global")


def test_cost_model_keys_encodes_by_size_and_crop_mode():
    """A global-crop camera's cheap encodes do not lower the estimate of a full-crop camera of
    the same size, and vice versa; batched-encode gains are learned per crop-mode mix."""
    cm = CostModel(encode_base_ms=5.0, encode_per_crop_ms=10.0, ema=0.5)
    full, glob = SimImage(BIG), SimImage(BIG, crops="global")
    assert cm.encode_ms(full) == 55.0 and cm.encode_ms(glob) == 15.0
    cm.observe_encode(full, 60.0)
    for _ in range(5):
        cm.observe_encode(glob, 9.0)
    assert cm.encode_ms(glob) == 9.0 and cm.encode_ms(full) == 60.0
    cm.observe_encode(full, 200.0)                  # dearer: a quarter of the way
    assert cm.encode_ms(full) == pytest.approx(60.0 + 0.5 * 140.0)
    assert cm.encode_ms(glob) == 9.0
    cm.observe_encode_batch([glob] * 4, 0.5 * 4 * 9.0)
    assert cm.batch_factor(4, "global") == 0.5 and cm.batch_factor(4) == 1.0
    assert cm.encode_batch_ms([glob] * 4) == pytest.approx(18.0)
    assert cm.encode_batch_ms([full] * 4) == pytest.approx(4 * cm.encode_ms(full))
    assert cm.batch_factor(4, "global+overlap") == 1.0


def test_encode_probe_per_crop_mode():
    """Two cameras of one size: "g" global crops (cheap, served every frame), "o" full crops
    whose encode estimate is a one-off slow outlier (1 s: e.g. a graph capture learned as its
    cost), so its frames look hopeless. The encode probe re-measures o's (size, crop mode)
    within probe_after_s; keyed by size only, g's encodes kept the timer fresh and o was never
    probed (task probes off here, to see the encode probe alone)."""
    clock = VirtualClock()
    true = CostModel(encode_base_ms=5.0, encode_per_crop_ms=10.0, prefill_base_ms=1.0,
                     prefill_per_token_ms=0.0, decode_step_ms={1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5},
                     ema=0.0)
    eng = SimEngine(clock, true, jitter=0.0)
    cm = true.scaled(1.0)
    cm.ema = 0.1
    cm.encode_seen[BIG] = 1000.0                     # the outlier, learned for o's key
    outs: list[Outcome] = []
    s = Scheduler(eng, cm, clock=clock, on_result=outs.append,
                  policy=Policy(task_probe_after_s=0.0))
    for k in range(80):                              # 8 s at 10 fps; o's frames 40 ms later
        clock.advance_to(k * 0.1)
        s.submit_frame("g", k, SimImage(BIG, (("person", 4),), crops="global"),
                       [("det", DET, 0.15)], capture_time=clock.now())
        s.run_until_idle()
        clock.advance_to(k * 0.1 + 0.04)
        s.submit_frame("o", k, SimImage(BIG, (("person", 4),)), [("det", DET, 0.15)],
                       capture_time=clock.now())
        s.run_until_idle()
    done = {c: sum(o.status is Status.DONE and o.stream == c for o in outs) for c in "go"}
    assert done["g"] >= 75, done
    assert s.metrics()["probes"] >= 1 and cm.encode_ms(SimImage(BIG)) < 100.0
    assert done["o"] >= 50, done                     # served from the first probe on (~2 s)
    assert cm.encode_ms(SimImage(BIG, crops="global")) == pytest.approx(15.0)
