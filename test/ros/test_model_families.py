"""Model families in the node's configuration, the live pipeline and replay (no DDS here;
test_node_families.py runs the node): tasks / crop modes a family does not serve are refused
with its message and the rest is served; a camera's crops mode reaches the engine per frame
(EncodeRequest), batched encodes go through the adapter; `photon replay` with Qwen 3.5 and
Gemma 4 tiny models."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

pytest.importorskip("torch")

from photon_core import models  # noqa: E402
from photon_ros.task_config import (ConfigError, config_from_params, make_task,  # noqa: E402
                                    new_refusals, restrict)

GEMMA = models.families()["gemma4"].CAPABILITIES
QWEN = models.families()["qwen3.5"].CAPABILITIES
MOONDREAM = models.families()["moondream2"].CAPABILITIES
GEMMA_DETECT = "Gemma 4 (E2B/E4B) does not support detect"


def params(**front):
    cam = {"topic": "/cam/front", "tasks": ["people", "scene"],
           "people": {"skill": "detect", "object": "person"},
           "scene": {"skill": "query", "question": "what is here?", "max_tokens": 4}}
    cam.update(front)
    return {"cameras": ["front"], "front": cam}


# -- configuration -----------------------------------------------------------------------------
def test_camera_crops_and_size_are_validated():
    cfg = config_from_params(params())
    assert cfg.camera("front").crops == "overlap" and cfg.camera("front").width == 0
    cfg = config_from_params(params(crops="global", width=640, height=480))
    c = cfg.camera("front")
    assert (c.crops, c.width, c.height) == ("global", 640, 480)
    assert config_from_params(params(crops="overlap:4")).camera("front").crops == "overlap:4"
    for bad, why in [({"crops": "tiles"}, "crops must be one of overlap, global"),
                     ({"crops": "overlap:0"}, "overlap:N"),
                     ({"crops": 3}, "expected a string"),
                     ({"width": 640}, "both width and height"),
                     ({"width": -1, "height": 4}, "must be >= 0")]:
        with pytest.raises(ConfigError, match=why):
            config_from_params(params(**bad))


def test_restrict_refuses_what_the_family_does_not_serve():
    cfg = config_from_params(params(crops="global"))
    g = restrict(cfg, GEMMA)
    assert [t.name for t in g.camera("front").tasks] == ["scene"]       # query still served
    assert g.camera("front").crops == "overlap"
    msgs = {r.where: r.message for r in g.refused}
    assert msgs["front.people"].startswith(GEMMA_DETECT)
    assert "does not support crops 'global'" in msgs["front.crops"]
    assert str(g.refused[0]).startswith("front.people refused: Gemma 4")
    assert [r.outcome for r in g.refused] == ["the other tasks are served",
                                              "camera front is served with crops 'overlap'"]
    q = restrict(cfg, QWEN)                      # every skill; whole-image encode only
    assert [t.name for t in q.camera("front").tasks] == ["people", "scene"]
    assert [r.where for r in q.refused] == ["front.crops"]
    m = restrict(cfg, MOONDREAM)
    assert m.refused == () and m.camera("front").crops == "global"
    assert restrict(cfg, None) is cfg


def test_parameter_updates_only_fail_on_new_refusals():
    old = restrict(config_from_params(params()), GEMMA)
    same = restrict(config_from_params(params(people={"skill": "detect", "object": "dog"})), GEMMA)
    assert new_refusals(old, same) == []         # refused at configure: stays refused, quietly
    worse = restrict(config_from_params(params(scene={"skill": "point", "object": "x"})), GEMMA)
    fresh = new_refusals(old, worse)
    assert [r.where for r in fresh] == ["front.scene"] and "does not support point" in fresh[0].message
    fixed = restrict(config_from_params(params(people={"skill": "caption"})), GEMMA)
    assert fixed.refused == () and len(fixed.camera("front").tasks) == 2


def test_query_and_set_tasks_refuse_with_the_family_message():
    cfg = config_from_params(params())
    with pytest.raises(ConfigError, match="request: Gemma 4 \\(E2B/E4B\\) does not support point"):
        make_task("on_demand", {"skill": "point", "object": "cup"}, cfg, "request", caps=GEMMA)
    assert make_task("on_demand", {"skill": "point", "object": "cup"}, cfg, "request",
                     caps=QWEN).skill == "point"
    from photon_ros.msg import TaskSpec
    from photon_ros.task_config import tasks_from_specs

    with pytest.raises(ConfigError, match=GEMMA_DETECT.replace("(", "\\(").replace(")", "\\)")):
        tasks_from_specs([TaskSpec(name="a", skill="caption"),
                          TaskSpec(name="b", skill="detect", object="x")], cfg, "front", GEMMA)


# -- crops per camera, batched encode through the adapter (tiny Moondream, CPU) ---------------
@pytest.fixture(scope="module")
def moondream(tmp_path_factory):
    from photon_core import load_model
    from photon_core.moondream.test_model import make_test_model

    d = make_test_model(tmp_path_factory.mktemp("md") / "m", seed=0, fast=True)
    return load_model(str(d), progress=False)


class EncodeSpy:
    """Records what the model encoded: (crops asked, EncodedImage) per frame, and the
    encode_batch calls."""

    def __init__(self, model, monkeypatch):
        self.seen, self.batches = [], []
        enc_image, enc_batch = model.encode_image, model.encode_batch

        def encode_image(image, crops=None):
            out = enc_image(image, crops)
            self.seen.append((getattr(image, "crops", None), out))
            return out

        def encode_batch(images, crops=None):
            out = enc_batch(images, crops)
            self.batches.append(len(images))
            self.seen += [(getattr(i, "crops", None), e) for i, e in zip(images, out)]
            return out
        monkeypatch.setattr(model, "encode_image", encode_image)
        monkeypatch.setattr(model, "encode_batch", encode_batch)


def two_cameras(model_dir="m", full_crops="overlap"):
    task = {"skill": "detect", "object": "person", "max_objects": 1, "deadline_ms": 60000.0}
    return config_from_params({
        "model": model_dir, "cameras": ["fast", "full"],
        "fast": {"topic": "/fast", "crops": "global", "tasks": ["people"], "people": task},
        "full": {"topic": "/full", "crops": full_crops, "tasks": ["people"], "people": task}})


def test_a_global_crop_camera_is_encoded_with_one_crop(moondream, monkeypatch):
    from photon_ros.live_pipeline import build_live_pipeline

    spy = EncodeSpy(moondream, monkeypatch)
    outcomes = []
    live = build_live_pipeline(two_cameras(), moondream, threaded=False, calibrate=False,
                               on_result=outcomes.append)
    assert live.engine.capabilities is MOONDREAM
    rng = np.random.default_rng(0)
    for i in range(3):
        for cam in ("fast", "full"):
            img = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
            ticket = live.accept(cam, 10.0 + i)
            assert live.submit(cam, ticket, img, arrival=live.scheduler.clock.now()) == 1
        live.scheduler.run_until_idle()
    assert len(outcomes) == 6 and all(str(o.status) == "done" for o in outcomes), \
        [(o.stream, str(o.status), o.error) for o in outcomes]
    by_mode = {}
    for crops, enc in spy.seen:
        by_mode.setdefault(crops, []).append(enc)
    assert set(by_mode) == {"global", "overlap"}           # every frame wrapped with its mode
    assert all(e.n_crops == 1 and e.crops == "global" for e in by_mode["global"])
    assert all(e.n_crops > 1 and e.crops == "overlap" for e in by_mode["overlap"])
    # on-demand requests on a camera's latest frame are wrapped the same way
    assert live.encode_input("fast", img).crops == "global"
    live.stop()


def test_a_crop_budget_camera_is_encoded_with_its_budget(moondream):
    """crops "overlap:N": the camera's frames go to the engine with the budget, and the encode
    tiles them with at most N local crops (120 x 160 on the tiny model: (1, 2) by default,
    (1, 1) with a budget of 1)."""
    from photon_ros.live_pipeline import build_live_pipeline

    live = build_live_pipeline(two_cameras(full_crops="overlap:1"), moondream, threaded=False,
                               calibrate=False)
    img = np.random.default_rng(2).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    req = live.encode_input("full", img)
    assert req.crops == "overlap:1"
    enc = moondream.encode_image(req)
    assert (enc.crops, enc.tiling, enc.n_crops) == ("overlap:1", (1, 1), 2)
    assert moondream.encode_image(img).n_crops == 3
    live.stop()


def test_an_adaptive_camera_reaches_the_engine_with_a_concrete_mode(moondream, monkeypatch):
    """Through the live pipeline and the scheduler: an unloaded adaptive camera's frames are
    encoded with the full crops; the scheduler's ladder knows the camera."""
    from photon_ros.live_pipeline import build_live_pipeline

    spy = EncodeSpy(moondream, monkeypatch)
    outcomes = []
    live = build_live_pipeline(two_cameras(full_crops="adaptive"), moondream, threaded=False,
                               calibrate=False, on_result=outcomes.append)
    rng = np.random.default_rng(5)
    for i in range(2):
        ticket = live.accept("full", 20.0 + i)
        live.submit("full", ticket, rng.integers(0, 256, (120, 160, 3), dtype=np.uint8),
                    arrival=live.scheduler.clock.now())
        live.scheduler.run_until_idle()
    assert [str(o.status) for o in outcomes] == ["done", "done"], outcomes
    assert spy.seen and {c for c, _ in spy.seen} == {"overlap"}
    assert all(e.n_crops == 3 for _, e in spy.seen)
    lad = live.scheduler.crop_ladder.summary()
    assert lad["streams"] == ["full"] and lad["frames"] == {"overlap": 2} and lad["level"] == 0
    live.stop()


def test_encode_batch_is_reached_through_the_adapter(moondream, monkeypatch):
    from photon_ros.live_pipeline import build_live_pipeline

    spy = EncodeSpy(moondream, monkeypatch)
    live = build_live_pipeline(two_cameras(), moondream, threaded=False, calibrate=False)
    assert callable(live.engine.encode_batch)
    rng = np.random.default_rng(1)
    for cam in ("fast", "full"):          # both frames waiting when the scheduler looks
        ticket = live.accept(cam, 5.0)
        live.submit(cam, ticket, rng.integers(0, 256, (120, 160, 3), dtype=np.uint8),
                    arrival=live.scheduler.clock.now())
    live.scheduler.run_until_idle()
    assert live.engine.encode_batches >= 1 and 2 in spy.batches, spy.batches
    assert live.scheduler.metrics()["encode_batches"].get(2, 0) >= 1      # sizes -> calls
    # one call, two crop modes: each frame encoded with its own (the reference engine's
    # encode_batch may itself go through encode_image per frame: recorded twice then)
    assert {(c, e.n_crops == 1) for c, e in spy.seen} == {("global", True), ("overlap", False)}
    live.stop()


def test_adapter_has_no_encode_batch_where_the_model_has_none():
    from photon_ros.engine_adapter import HookedEngine

    class Whole:
        capabilities = QWEN
        model_id = "w"

    eng = HookedEngine(Whole())
    assert eng.capabilities is QWEN and not hasattr(eng, "encode_batch")
    assert not hasattr(eng, "crop_count")

    class Tiled(Whole):
        def crop_count(self, height, width, crops):
            return 7
    assert HookedEngine(Tiled()).crop_count(480, 640, "overlap") == 7


def test_prepare_encode_for_each_configured_camera_size():
    from photon_ros.live_pipeline import prepare_encodes

    calls = []

    def prepare(shapes, batch_sizes, crops):
        calls.append((shapes, batch_sizes, crops))
        return len(batch_sizes)
    task = {"skill": "query", "question": "q"}
    cfg = config_from_params({
        "max_batch": 4, "cameras": ["a", "b", "c", "d"],
        "a": {"topic": "/a", "width": 640, "height": 480, "tasks": ["t"], "t": task},
        "b": {"topic": "/b", "width": 640, "height": 480, "tasks": ["t"], "t": task},
        "c": {"topic": "/c", "width": 320, "height": 240, "crops": "global", "tasks": ["t"],
              "t": task},
        "d": {"topic": "/d", "tasks": ["t"], "t": task}})          # size unknown: nothing
    assert prepare_encodes(prepare, cfg) == 3
    assert calls == [(((240, 320),), (1,), ("global",)), (((480, 640),), (1, 2), ("overlap",))]


# -- photon replay with Qwen 3.5 and Gemma 4 tiny models ------------------------------------
@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    from photon_ros.sample_bag import make_sample_bag

    d = tmp_path_factory.mktemp("bag") / "in"
    make_sample_bag(d, seconds=0.4, fps=5, width=64, height=48)
    return d


@pytest.mark.parametrize("family", ["qwen3.5", "gemma4"])
def test_replay_with_a_family_model(family, bag, tmp_path, capsys):
    from photon_core.cli import main as photon
    from photon_ros.bag_io import read_all

    model = tmp_path / "model"
    assert photon(["make-test-model", family, str(model)]) == 0
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "cameras": ["front"], "front": {
            "topic": "/camera/image_raw", "tasks": ["people", "scene"],
            "people": {"skill": "detect", "object": "person", "max_objects": 1},
            "scene": {"skill": "query", "question": "what?", "max_tokens": 3}}}}}))
    capsys.readouterr()
    rc = photon(["replay", str(bag), "--params", str(p), "--out", str(tmp_path / "out"),
                 "--model", str(model), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    topics = [m.topic for m in read_all(tmp_path / "out") if m.msgtype.startswith("photon_ros/")]
    summary = json.loads((tmp_path / "out" / "replay_summary.json").read_text()) \
        if (tmp_path / "out" / "replay_summary.json").exists() else None
    frames = 2
    assert topics.count("/front/answer") == frames
    if family == "gemma4":
        assert "/front/detections" not in topics
        assert GEMMA_DETECT in err and "front.people refused" in err
    else:
        assert topics.count("/front/detections") == frames and "refused" not in err
    if summary is not None:
        assert bool(summary["refused"]) == (family == "gemma4")


def test_camera_diagnostics_name_the_cheaper_crop_modes():
    """A camera whose deadlines the scheduler cannot meet (WARN with skipped requests) is told
    which cheaper crop modes its family serves; a family without crop modes, a camera that is
    already on the global view, or a stalled camera with nothing skipped get no such advice."""
    import time

    from photon_core.scheduler.stream_health import StreamHealth
    from photon_ros.camera_stats import CameraStats
    from photon_ros.diagnostics import camera_status, crop_advice

    snap = CameraStats().snapshot(time.monotonic())
    assert crop_advice(MOONDREAM, "overlap") == ("overlap", ("overlap:4", "global"))
    assert crop_advice(MOONDREAM, "overlap:4") == ("overlap:4", ("global",))
    assert crop_advice(MOONDREAM, "global") == ("global", ())
    assert crop_advice(QWEN, "overlap") == ("", ()) and crop_advice(None, "overlap") == ("", ())

    def health(skipped_frac):
        return StreamHealth("front", "warn", "80 % of its last 10 task requests not answered",
                            1.0, skipped_frac, 0.0, 0.5, 10, 2, 8, 10)

    st = camera_status("n", "front", "/t", snap, True, health(0.8),
                       *crop_advice(MOONDREAM, "overlap"))
    vals = {kv.key: kv.value for kv in st.values}
    assert "crops overlap: a cheaper mode encodes faster (overlap:4 or global)" in st.message
    assert vals["crops"] == "overlap"
    for h, advice in ((health(0.8), crop_advice(MOONDREAM, "global")),
                      (health(0.8), crop_advice(QWEN, "overlap")),
                      (health(0.0), crop_advice(MOONDREAM, "overlap"))):
        st = camera_status("n", "front", "/t", snap, True, h, *advice)
        assert "cheaper mode" not in st.message and "scheduler:" in st.message
    assert "crops" not in {kv.key for kv in camera_status(
        "n", "front", "/t", snap, True, health(0.8), *crop_advice(QWEN, "overlap")).values}


def test_an_adaptive_camera_is_handed_over_for_the_scheduler_to_pick():
    """crops "adaptive": accepted for Moondream 2, refused (back to overlap) for a whole-image
    family; the live pipeline hands its frames over as AdaptiveCrops (the scheduler resolves
    them), the synchronous path (offline replay) encodes them with the ladder's best mode;
    encode graphs are prepared for every mode of the ladder; the camera's diagnostics show
    the current mode and give no advice (it steps down by itself)."""
    from photon_core.scheduler import AdaptiveCrops, CropLadder
    from photon_core.scheduler.crop_ladder import LADDER
    from photon_ros.diagnostics import crop_advice
    from photon_ros.live_pipeline import prepare_encodes
    from photon_ros.pipeline import PerceptionPipeline

    cfg = config_from_params(params(crops="adaptive", width=640, height=480))
    assert cfg.camera("front").crops == "adaptive"
    assert restrict(cfg, MOONDREAM).refused == ()
    q = restrict(cfg, QWEN)
    assert q.camera("front").crops == "overlap"
    assert "does not support crops 'adaptive'" in q.refused[0].message

    class Model:
        capabilities = MOONDREAM

    pipe = PerceptionPipeline(cfg, Model())
    img = np.zeros((48, 64, 3), np.uint8)
    live_in = pipe.encode_input("front", img, adaptive=True)
    assert isinstance(live_in, AdaptiveCrops) and live_in.modes == LADDER
    sync_in = pipe.encode_input("front", img)
    assert sync_in.crops == LADDER[0] and sync_in.image is img
    calls = []
    prepare_encodes(lambda **kw: calls.append(kw["crops"]) or 1, cfg)
    assert sorted(calls) == sorted((m,) for m in LADDER)
    lad = CropLadder()
    assert crop_advice(MOONDREAM, "adaptive", lad) == ("adaptive (now overlap)", ())
    lad.level = 2
    assert crop_advice(MOONDREAM, "adaptive", lad) == ("adaptive (now global)", ())
