"""Adaptive crops (photon_core/scheduler/crop_ladder.py): the crop ladder's steps on synthetic
outcomes, and through the scheduler in the simulator (virtual clock, measured H200 costs):
an overloaded set of adaptive cameras steps down and answers more frames in time than with
the full crops; a light one keeps the full crops."""
from __future__ import annotations

import numpy as np
import pytest

from photon_core.encode_request import EncodeRequest
from photon_core.scheduler import AdaptiveCrops, CropLadder
from photon_core.scheduler.request import ON_DEMAND, PERIODIC, Outcome, Status
from photon_core.scheduler.simulator import VGA, TraceSpec, simulate

MODES = ("overlap", "overlap:4", "global")


def outcome(stream="a", status=Status.DONE, t=0.0, submit=None, late=False, kind=PERIODIC,
            probe=False):
    return Outcome(request_id=0, stream=stream, stamp=t, task_name="x", kind=kind,
                   status=status, submit_time=t if submit is None else submit, end_time=t,
                   missed_deadline=late, probe=probe)


def test_adaptive_frames_are_checked():
    img = np.zeros((4, 4, 3), np.uint8)
    assert AdaptiveCrops(img).modes == MODES
    for bad in ((), ("overlap", "tiles")):
        with pytest.raises(ValueError):
            AdaptiveCrops(img, bad)
    with pytest.raises(ValueError, match="bare image"):
        AdaptiveCrops(EncodeRequest(img))


def test_resolve_gives_the_current_mode_and_leaves_other_images_alone():
    lad, img = CropLadder(), np.zeros((4, 4, 3), np.uint8)
    assert lad.resolve("a", img, 0.0) is img and lad.summary() == {}
    req = lad.resolve("a", AdaptiveCrops(img), 0.0)
    assert isinstance(req, EncodeRequest) and req.crops == "overlap" and req.image is img
    assert lad.summary()["frames"] == {"overlap": 1} and lad.summary()["streams"] == ["a"]


def test_steps_down_on_unanswered_frames_and_stops_at_the_last_mode():
    lad = CropLadder(window_s=2.0, min_outcomes=4, down_frac=0.1)
    assert lad.mode("a", MODES, 0.0) == "overlap"
    for i in range(10):                      # answered in time
        lad.note(outcome(status=Status.DONE, t=0.1 * i), 0.1 * i)
    lad.note(outcome(status=Status.SUPERSEDED, t=0.95, probe=True), 0.95)  # a probe: not counted
    for _ in range(2):                       # on-demand questions: their own deadlines
        lad.note(outcome(stream="a", status=Status.SKIPPED, kind=ON_DEMAND, t=1.0), 1.0)
    assert lad.level == 0
    lad.note(outcome(status=Status.DONE, t=1.35, late=True), 1.35)   # answered late: failed
    assert lad.level == 0                                             # (one is not enough)
    lad.note(outcome(status=Status.SUPERSEDED, t=1.36), 1.36)  # not started before the next
    assert lad.level == 1 and lad.mode("a", MODES, 1.4) == "overlap:4"
    for i in range(3):                       # 3 outcomes: fewer than min_outcomes
        lad.note(outcome(status=Status.SKIPPED, t=1.42 + 0.01 * i, submit=1.4), 1.42)
    assert lad.level == 1
    lad.note(outcome(status=Status.SKIPPED, t=1.5, submit=1.3), 1.5)  # submitted before the step
    for i in range(4):
        lad.note(outcome(status=Status.DEADLINE, t=2.0 + 0.1 * i, submit=1.5), 2.0 + 0.1 * i)
    assert lad.level == 2 and lad.mode("a", MODES, 2.5) == "global"
    for i in range(8):
        lad.note(outcome(status=Status.ERROR, t=3.0 + 0.1 * i, submit=2.6), 3.0 + 0.1 * i)
    assert lad.level == 2 and lad.steps == {"down": 2}


def test_one_failure_is_not_enough():
    lad = CropLadder(down_frac=0.1)
    lad.mode("a", MODES, 0.0)
    for i in range(10):
        lad.note(outcome(status=Status.SKIPPED if i == 3 else Status.DONE, t=0.1 * i), 0.1 * i)
    assert lad.level == 0
    lad.note(outcome(status=Status.SKIPPED, t=1.0), 1.0)      # 2 of 11
    assert lad.level == 1


def test_steps_up_after_a_clean_hold_and_backs_off_when_it_does_not_hold():
    lad = CropLadder(window_s=2.0, hold_s=4.0, max_hold_s=16.0)
    lad.mode("a", MODES, 0.0)

    def fail(t0):
        for i in range(4):
            lad.note(outcome(status=Status.SKIPPED, t=t0 + 0.01 * i), t0 + 0.01 * i)
    fail(0.5)
    assert lad.level == 1
    assert lad.mode("a", MODES, 3.0) == "overlap:4"          # not held for 4 s yet
    lad.note(outcome(status=Status.SKIPPED, t=3.5, submit=3.0), 3.5)   # one failure: 1 of 1
    assert lad.mode("a", MODES, 4.6) == "overlap:4"          # a failure in the window
    assert lad.mode("a", MODES, 6.0) == "overlap"            # clean for the window: up
    assert lad.steps == {"down": 1, "up": 1}
    fail(6.5)                                # the up-step did not hold (down at 6.53)
    assert lad.level == 1 and lad.hold == 8.0
    assert lad.mode("a", MODES, 6.53 + 7.9) == "overlap:4"   # the doubled hold
    assert lad.mode("a", MODES, 6.53 + 8.0) == "overlap"
    fail(15.0)
    assert lad.hold == 16.0
    assert lad.mode("a", MODES, 15.03 + 16.0) == "overlap"
    assert lad.mode("a", MODES, 31.03 + 16.0) == "overlap"   # held: the hold resets
    assert lad.hold == 4.0 and lad.level == 0


def test_the_scheduler_counts_only_the_adaptive_frames_outcomes():
    """Failures (here: invalid tasks, ERROR at submission) of a stream submitting plain frames
    do not move the ladder; those of an AdaptiveCrops frame do, and its frame reaches the
    engine as an EncodeRequest with the ladder's mode."""
    from photon_core.scheduler import Scheduler, VirtualClock
    from photon_core.scheduler.simulator import TRUE_COST, SimEngine
    from photon_core.task import Task

    clock = VirtualClock()
    sched = Scheduler(SimEngine(clock, TRUE_COST), clock=clock)
    sched.crop_ladder = CropLadder(min_outcomes=2)
    bad = [("q", Task("query", question=""), 1.0)]
    good = [("q", Task("query", question="a?"), 9.0)]
    img = np.zeros((4, 4, 3), np.uint8)
    sched.submit_frame("cam", 0, AdaptiveCrops(img), good)      # waits in the queue
    first = sched.frames[("cam", 0)]
    assert first.adaptive and isinstance(first.image, EncodeRequest)
    assert first.image.crops == "overlap" and first.image.image is img
    for i in range(4):
        sched.submit_frame("plain", i, img, bad)
    assert sched.crop_ladder.level == 0 and sched.metrics()["errors"] == 4
    sched.submit_frame("cam", 1, AdaptiveCrops(img), bad)
    assert sched.crop_ladder.level == 0                      # one failure is not enough
    sched.submit_frame("cam", 2, AdaptiveCrops(img), bad)
    assert sched.crop_ladder.level == 1
    sched.submit_frame("cam", 3, AdaptiveCrops(img), good)
    assert sched.frames[("cam", 3)].image.crops == "overlap:4"
    assert sched.crop_ladder.summary()["streams"] == ["cam"]


def test_one_level_for_every_adaptive_stream():
    lad = CropLadder()
    lad.mode("a", MODES, 0.0)
    lad.mode("b", MODES, 0.0)
    for i in range(4):
        lad.note(outcome(stream="b", status=Status.SKIPPED, t=0.1 * i), 0.1 * i)
    assert lad.mode("a", MODES, 0.5) == "overlap:4"
    # a frame with a shorter ladder never gets an index past its own modes
    assert lad.mode("c", ("overlap",), 0.6) == "overlap"


def _four_cameras(adaptive: bool, seed: int = 0, cameras: int = 4, fps: float = 15.0):
    # the simulator's crop estimate for a 640x480 frame is 5 crops (cost_model.moondream_crops)
    # and overlap:4 costs as much there; overlap:1 = 2 crops
    spec = TraceSpec(cameras=cameras, fps=fps, duration_s=20.0, profile="h200",
                     image_shape=VGA, deadline_s=0.1, task_names=("person5",), max_batch=4,
                     encode_batch_gain=0.05, even_phases=True, seed=seed,
                     crop_modes=("overlap", "overlap:1", "global") if adaptive else ())
    return simulate(spec)


@pytest.mark.parametrize("seed", [0, 1])
def test_overloaded_adaptive_cameras_step_down_and_answer_more_in_time(seed):
    fixed, adaptive = _four_cameras(False, seed), _four_cameras(True, seed)
    assert fixed.sched_metrics["crop_ladder"] == {}
    lad = adaptive.sched_metrics["crop_ladder"]
    assert lad["steps"]["down"] >= 1 and lad["streams"] == ["cam0", "cam1", "cam2", "cam3"]
    assert sum(lad["frames"].values()) >= 4 * 300     # (+ on-demand questions' frames)
    assert adaptive.metrics["answered"] >= fixed.metrics["answered"] + 0.2, \
        (fixed.metrics["answered"], adaptive.metrics["answered"], lad)
    assert adaptive.metrics["answered"] >= 0.9
    assert adaptive.metrics["miss_rate"] <= 0.02


def test_a_light_load_keeps_the_full_crops():
    res = _four_cameras(True, cameras=1, fps=5.0)
    lad = res.sched_metrics["crop_ladder"]
    assert lad["level"] == 0 and lad["steps"] == {} and set(lad["frames"]) == {"overlap"}
    assert lad["frames"]["overlap"] >= 100
    assert res.metrics["answered"] == 1.0
