"""photon_core.models: the family of a checkpoint comes from its config.json; load_model and
load_engine go through the registry; the engine contract is typed (photon_core.engine)."""
from __future__ import annotations

import json
import shutil

import pytest

from photon_core import EngineOptions, Task, load_engine, load_model
from photon_core import models


def test_every_family_follows_the_contract():
    fams = models.families()
    assert "moondream2" in fams
    for name, fam in fams.items():
        assert fam.FAMILY == name and isinstance(fam.MODEL_TYPES, tuple)
        assert isinstance(fam.SKILLS, frozenset) and fam.SKILLS
        assert callable(fam.load_model) and callable(fam.make_test_model)


def test_family_from_model_type(tmp_path, fast_dir):
    assert models.family_for(None).FAMILY == "moondream2"          # no model_type: fallback
    assert models.family_for("moondream1").FAMILY == "moondream2"
    with pytest.raises(models.UnknownModelType, match="no model family serves"):
        models.family_for("no-such-arch")
    assert models.read_model_type(str(fast_dir)) is None           # our tiny checkpoints
    ck = tmp_path / "ck"
    shutil.copytree(fast_dir, ck)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-arch"}))
    assert models.read_model_type(str(ck)) == "no-such-arch"
    with pytest.raises(models.UnknownModelType):
        load_model(str(ck), progress=False)                        # a clear error, no guess


def test_load_model_and_engine_go_through_the_registry(fast_dir, image):
    from photon_core.engine import Engine, PrefixState, Run
    from photon_core.models.moondream2 import MoondreamModel

    m = load_model(str(fast_dir), progress=False)
    assert isinstance(m, MoondreamModel) and isinstance(m, Engine)
    enc = m.encode_image(image)
    assert isinstance(enc, PrefixState) and enc.length == m.prefix_len
    assert enc.n_crops == 1 + enc.tiling[0] * enc.tiling[1] and enc.recurrent == ()
    run = m.start(enc, Task("point", object="cup", max_objects=1))
    assert isinstance(run, Run)
    fe = load_engine(str(fast_dir), options=EngineOptions(engine="fast", max_batch=2,
                                                          crops_on_device=False),
                     progress=False)
    assert isinstance(fe, Engine) and fe.max_runs == 2 and fe.options.fused == "auto"
    assert fe.model.crops_on_device is False
    fe.close()


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="engine"):
        EngineOptions(engine="turbo")
    with pytest.raises(ValueError, match="fused"):
        EngineOptions(fused="maybe")
    with pytest.raises(ValueError, match="attention"):
        EngineOptions(attention="flash")
    assert EngineOptions().with_(max_batch=2, deterministic=None).max_batch == 2


def test_cli_make_test_model_uses_the_registry(tmp_path, capsys):
    from photon_core.cli import main

    assert main(["make-test-model", "moondream2", str(tmp_path / "m"), "--fast"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert main(["make-test-model", "nope", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "unknown model family 'nope'" in err and "moondream2" in err.split("known:")[1]
