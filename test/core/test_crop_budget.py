"""The "overlap:N" crop mode (photon_core/encode_request.py): a frame's local crops capped at
N - the model's own tiling rule with its max_crops setting lowered for that frame - on the
reference encode, the batched encode, the fast engine and the scheduler's cost model (CPU,
the tiny Moondream 2 model: max_crops 4, 84-px crops)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from photon_core.encode_request import EncodeRequest, crop_budget, parse_crops
from photon_core.engine import EngineOptions
from photon_core.fast import FastEngine
from photon_core.models.moondream2.config import MoondreamConfig
from photon_core.models.moondream2.crops import crop_geometry
from photon_core.models.moondream2.model import MoondreamModel
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
from photon_core.scheduler.cost_model import CostModel, encode_key


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def frame():
    # 120 x 130: a (2, 2) tiling under the tiny model's max_crops 4, (1, 1) under 2 or 3
    return np.random.default_rng(3).integers(0, 256, (120, 130, 3), dtype=np.uint8)


def capped(model, max_crops: int) -> MoondreamModel:
    """The same weights with the config's max_crops set to max_crops."""
    cfg = replace(model.config, vision=replace(model.config.vision, max_crops=max_crops))
    return MoondreamModel(cfg, model.weights, model.tokenizer)


def test_modes_parse_and_bad_ones_are_refused():
    assert parse_crops("overlap:4") == ("overlap:N", 4)
    assert parse_crops("overlap") == ("overlap", None) and parse_crops("global")[1] is None
    for bad in ("overlap:0", "overlap:-1", "overlap:04", "overlap:", "overlap:x", "overlap:65",
                "overlap:²", "overlap 4", "Overlap:4", 4, None):
        with pytest.raises(ValueError, match="expected overlap, global or overlap:N"):
            parse_crops(bad)
        with pytest.raises(ValueError):
            EncodeRequest(np.zeros((4, 4, 3), np.uint8), crops=bad)
    with pytest.raises(ValueError, match="overlap:N"):
        EngineOptions(crops="overlap:0")
    assert EngineOptions(crops="overlap:3").crops == "overlap:3"
    assert crop_budget("overlap", 12) == 12 and crop_budget("overlap:4", 12) == 4
    assert crop_budget("overlap:40", 12) == 12          # above the model's: the model's


def test_640x480_tilings_of_moondream2():
    """The real model's geometry: 9 crops by default, "overlap:4" = 1 + 2 x 2."""
    v = MoondreamConfig().vision
    geo = lambda mode: crop_geometry(480, 640, mode, v.crop_size, v.enc_patch_size,  # noqa: E731
                                     v.overlap_margin, v.max_crops)[:2]
    assert geo("overlap") == ((2, 4), 9) == geo("overlap:12") == geo("overlap:64")
    assert geo("overlap:8") == ((2, 3), 7)
    assert geo("overlap:4") == ((2, 2), 5) == geo("overlap:6")
    assert geo("overlap:1") == ((1, 1), 2)
    assert geo("global") == ((1, 1), 1)


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_a_budget_is_the_model_with_that_max_crops(model, frame, budget):
    """encode_image(crops="overlap:N") = the encode of the same weights with max_crops = N,
    bit for bit (the PIL crops on the CPU and the torch crops alike)."""
    mode = f"overlap:{budget}"
    want = capped(model, budget).encode_image(frame)
    for on_device in (None, True):
        model.crops_on_device = on_device
        try:
            got = model.encode_image(frame, crops=mode)
        finally:
            model.crops_on_device = None
        assert torch.equal(got.kv, want.kv)
        assert (got.tiling, got.n_crops, got.crops) == (want.tiling, want.n_crops, mode)
    full = model.encode_image(frame)
    assert full.tiling == (2, 2) and got.tiling == (1, 1) and got.n_crops == 2
    assert not torch.equal(got.kv, full.kv)


def test_a_budget_at_or_above_max_crops_is_the_full_encode(model, frame):
    full = model.encode_image(frame)
    for mode in ("overlap:4", "overlap:9"):
        got = model.encode_image(EncodeRequest(frame, mode))
        assert torch.equal(got.kv, full.kv) and got.tiling == full.tiling
        assert got.crops == mode


def test_batched_and_fast_encodes_take_the_budget(model, frame):
    """encode_batch with mixed modes and FastEngine (CPU: eager, no graphs) give each frame
    encode_image's prefix state for its mode."""
    other = np.random.default_rng(4).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    reqs = [EncodeRequest(frame, "overlap:2"), frame, EncodeRequest(other, "overlap:1"),
            EncodeRequest(frame, "global")]
    want = [model.encode_image(r) for r in reqs]
    fe = FastEngine(model, max_batch=2)
    try:
        for got in (model.encode_batch(reqs), fe.encode_batch(reqs),
                    [fe.encode_image(r) for r in reqs]):
            for g, w in zip(got, want):
                assert torch.allclose(g.kv, w.kv, rtol=1e-4, atol=1e-4)
                assert (g.tiling, g.n_crops, g.crops) == (w.tiling, w.n_crops, w.crops)
        assert [w.n_crops for w in want] == [2, 5, 2, 1]
        # the engine-wide default
        fe2 = FastEngine(model, max_batch=1, options=EngineOptions(crops="overlap:2"))
        try:
            assert fe2.encode_image(frame).crops == "overlap:2"
        finally:
            fe2.close()
    finally:
        fe.close()


def test_the_cost_model_counts_a_budget_and_keys_it_apart():
    cost = CostModel(encode_base_ms=4.0, encode_per_crop_ms=1.0)
    frame = np.zeros((480, 640, 3), np.uint8)
    full, four, one = (encode_key(EncodeRequest(frame, m))
                       for m in ("overlap", "overlap:4", "overlap:1"))
    assert full == (480, 640) and four == (480, 640, "overlap:4")
    n_full = cost._crops(full)
    assert cost._crops(four) == min(5, n_full) and cost._crops(one) == 2
    assert cost._crops((480, 640, "global")) == 1
    cost.ema = 0.5
    cost.observe_encode(EncodeRequest(frame, "overlap:4"), 3.0)
    assert cost.encode_ms(EncodeRequest(frame, "overlap:4")) == 3.0
    assert cost.encode_ms(frame) != 3.0                     # the full mode is costed apart


def test_the_engines_count_a_frames_crops_before_encoding_it(model):
    """crop_count (the reference and the fast engine, the node's HookedEngine) gives what the
    encode then runs, for every mode; a calibrated cost model takes it in place of its
    size estimate (cost_model.moondream_crops: 5 for a real 640x480 frame, which runs 9)."""
    from photon_core.scheduler.engine import crop_counter

    fe = FastEngine(model, max_batch=1)
    try:
        rng = np.random.default_rng(0)
        for h, w in ((40, 50), (120, 130), (90, 260), (300, 90)):
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for mode in ("overlap", "overlap:1", "overlap:3", "global"):
                n = model.encode_image(img, crops=mode).n_crops
                assert model.crop_count(h, w, mode) == n, (h, w, mode)
                assert fe.crop_count(h, w, mode) == n, (h, w, mode)
        assert fe.crop_count(120, 130) == 5 and crop_counter(fe) == fe.crop_count
        cost = CostModel(encode_base_ms=4.0, encode_per_crop_ms=1.0, crop_count=fe.crop_count)
        assert cost._crops((120, 130)) == 5 and cost._crops((120, 130, "overlap:1")) == 2
        assert cost.encode_ms(shape=(120, 130, "global")) == 5.0
    finally:
        fe.close()
    # the real model's 640x480 frame: its tiling rule against the size estimate
    real = MoondreamModel(MoondreamConfig(), model.weights, model.tokenizer)
    assert real.crop_count(480, 640) == 9 and real.crop_count(480, 640, "overlap:4") == 5
    estimate = CostModel(encode_base_ms=4.0, encode_per_crop_ms=1.0)
    counted = CostModel(encode_base_ms=4.0, encode_per_crop_ms=1.0, crop_count=real.crop_count)
    assert estimate._crops((480, 640)) == 5 and counted._crops((480, 640)) == 9
    assert counted.scaled(2.0)._crops((480, 640, "overlap:4")) == 5


def test_calibration_takes_the_engines_crop_count(model):
    from photon_core.scheduler.engine import crop_counter

    cost = CostModel.calibrate(model, image_sizes=((40, 50), (120, 130)), batch_sizes=(1,),
                               steps=1, repeats=1)
    assert cost.crop_count == model.crop_count and crop_counter(object()) is None
