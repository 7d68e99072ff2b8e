"""What a model family serves (photon_core.engine.Capabilities): on every family, known from
config.json before loading (the registry), on every engine (reference and FastEngine), used by
the `photon` CLI; and the cost model keeping global-crop frames apart."""
from __future__ import annotations

import json

import numpy as np
import pytest

from photon_core import models
from photon_core.cli import main as photon
from photon_core.encode_request import EncodeRequest
from photon_core.engine import Capabilities, Engine
from photon_core.task import SKILLS, TaskError

GEMMA_DETECT = "Gemma 4 (E2B/E4B) does not support detect"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from photon_core.models import gemma4, qwen3_5

    d = tmp_path_factory.mktemp("families")
    return {"qwen3.5": qwen3_5.make_test_model(d / "qwen", seed=0),
            "gemma4": gemma4.make_test_model(d / "gemma", seed=0)}


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    from PIL import Image

    p = tmp_path_factory.mktemp("img") / "frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(p)
    return p


def test_every_family_declares_its_capabilities():
    want = {"moondream2": (set(SKILLS), ("overlap", "global", "overlap:N")),
            "qwen3.5": (set(SKILLS), ("overlap",)),
            "gemma4": ({"query", "caption"}, ("overlap",))}
    for name, fam in models.families().items():
        caps = fam.CAPABILITIES
        assert isinstance(caps, Capabilities) and caps.family == name
        assert caps.skills == fam.SKILLS
        assert (set(caps.skills), tuple(caps.crop_modes)) == want[name]
        for s in SKILLS:
            assert (caps.skill_refusal(s) == "") == (s in caps.skills)


def test_refusals_carry_the_family_message():
    caps = models.families()["gemma4"].CAPABILITIES
    assert caps.skill_refusal("detect").startswith(GEMMA_DETECT)
    assert "point" in caps.skill_refusal("point")
    with pytest.raises(TaskError, match="does not support point"):
        caps.check_skill("point")
    caps.check_skill("query")                              # served: no error
    assert "does not support crops 'global'" in caps.crops_refusal("global")
    assert caps.crops_refusal("overlap") == ""
    assert "does not support crops 'overlap:4'" in caps.crops_refusal("overlap:4")
    assert not caps.serves_crops("overlap:4") and caps.serves_crops("overlap")
    md = models.families()["moondream2"].CAPABILITIES
    assert md.crops_refusal("global") == "" and md.skill_refusal("point") == ""
    assert md.crops_refusal("overlap:4") == "" and md.serves_crops("overlap:12")
    assert not md.serves_crops("overlap:0") and md.crops_refusal("tiles") == ""  # check_crops'
    with pytest.raises(ValueError, match="crop modes of toy"):
        Capabilities("toy", "Toy", crop_modes=("overlap", "overlap:4"))
    generic = Capabilities("toy", "Toy", frozenset({"query"}))
    assert generic.skill_refusal("detect") == "Toy does not support detect; it serves query"
    with pytest.raises(ValueError, match="unknown skills"):
        Capabilities("toy", "Toy", frozenset({"segment"}))
    with pytest.raises(ValueError, match="overlap"):
        Capabilities("toy", "Toy", crop_modes=("global",))


def test_registry_reads_capabilities_without_loading(ckpts, fast_dir):
    assert models.capabilities(str(ckpts["gemma4"])).family == "gemma4"
    assert models.capabilities(str(ckpts["qwen3.5"])).family == "qwen3.5"
    assert models.capabilities(str(fast_dir)).family == "moondream2"


def test_engines_carry_their_family_capabilities(ckpts, fast_dir):
    from photon_core import EngineOptions, load_engine, load_model

    for name, path in ckpts.items():
        m = load_model(str(path), progress=False)
        assert m.capabilities is models.families()[name].CAPABILITIES
        assert isinstance(m, Engine)
    fe = load_engine(str(fast_dir), options=EngineOptions(engine="fast", max_batch=1),
                     progress=False)
    try:
        assert fe.capabilities is models.families()["moondream2"].CAPABILITIES
        assert isinstance(fe, Engine)
    finally:
        fe.close()
    fq = load_engine(str(ckpts["qwen3.5"]), options=EngineOptions(engine="fast", max_batch=1),
                     progress=False)
    try:
        assert fq.capabilities.family == "qwen3.5" and isinstance(fq, Engine)
    finally:
        fq.close()


def test_cli_refuses_an_unsupported_skill_before_loading(ckpts, png, capsys, monkeypatch):
    import photon_core

    def no_load(*a, **k):
        raise AssertionError("the model was loaded for a skill its family does not serve")
    monkeypatch.setattr(photon_core, "load_model", no_load)
    for skill in ("detect", "point"):
        rc = photon([skill, "--model", str(ckpts["gemma4"]), "--image", str(png),
                     "--object", "cup"])
        err = capsys.readouterr().err
        assert rc == 2 and f"Gemma 4 (E2B/E4B) does not support {skill}" in err, err


@pytest.mark.parametrize("args,key", [
    (["detect", "--object", "cup", "--max-objects", "1"], "objects"),
    (["point", "--object", "cup", "--max-objects", "1"], "points"),
    (["query", "--question", "what is it?", "--max-tokens", "4"], "answer"),
    (["caption", "--length", "short", "--max-tokens", "4"], "caption")])
def test_cli_every_skill_with_a_qwen_model(ckpts, png, capsys, args, key):
    rc = photon([*args, "--model", str(ckpts["qwen3.5"]), "--image", str(png)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out.strip().splitlines()[-1])
    assert key in res and res["finish_reason"] in ("stop", "length") and res["tokens"] >= 1
    if key in ("objects", "points"):
        assert isinstance(res[key], list) and len(res[key]) <= 1
    else:
        assert isinstance(res[key], str)


def test_cli_gemma_serves_query(ckpts, png, capsys):
    rc = photon(["query", "--model", str(ckpts["gemma4"]), "--image", str(png), "--question",
                 "what?", "--max-tokens", "3"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out.strip().splitlines()[-1])
    assert isinstance(res["answer"], str) and res["tokens"] == 3


def test_cost_model_keys_global_crop_frames_apart():
    from photon_core.scheduler.cost_model import CostModel, encode_key

    img = np.zeros((480, 640, 3), np.uint8)
    assert encode_key(img) == (480, 640)
    assert encode_key(EncodeRequest(img, crops="overlap")) == (480, 640)
    assert encode_key(EncodeRequest(img, crops="global")) == (480, 640, "global")
    cost = CostModel(encode_base_ms=5.0, encode_per_crop_ms=10.0, ema=0.0)
    # before any measurement: 1 crop for the global frame, the tiling's crops otherwise
    assert cost.encode_ms(EncodeRequest(img, crops="global")) == pytest.approx(15.0)
    assert cost.encode_ms(img) == pytest.approx(5.0 + 10.0 * 5)
    cost = CostModel()
    cost.observe_encode(EncodeRequest(img, crops="global"), 3.0)
    cost.observe_encode(img, 30.0)
    assert cost.encode_ms(EncodeRequest(img, crops="global")) == pytest.approx(3.0)
    assert cost.encode_ms(img) == pytest.approx(30.0)
