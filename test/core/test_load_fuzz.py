"""Broken model folders: every one gives a ValueError that names the bad file, and `photon`
prints it in one line (exit 2), never a traceback. Weights come only through safetensors."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from photon_core.moondream import WeightsError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _header_garbage(d):
    p = d / "model.safetensors"
    b = bytearray(p.read_bytes())
    b[8:40] = b"{not json at all, nor a header!"
    p.write_bytes(bytes(b))


def _random_bytes(d):
    (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))


def _pickle(d):
    with open(d / "model.safetensors", "wb") as f:
        pickle.dump({"text.wte": [1.0, 2.0]}, f, protocol=4)


def _empty(d):
    (d / "model.safetensors").write_bytes(b"")


def _huge_header_len(d):
    (d / "model.safetensors").write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")


BROKEN_WEIGHTS = {"truncated": (_truncate, "truncated or corrupt"),
                  "header": (_header_garbage, "truncated or corrupt"),
                  "random": (_random_bytes, "truncated or corrupt"),
                  "pickle": (_pickle, "pickle"),
                  "empty": (_empty, "model.safetensors"),
                  "huge_header": (_huge_header_len, "model.safetensors")}


@pytest.mark.parametrize("case", sorted(BROKEN_WEIGHTS))
def test_broken_weights_name_the_file(fast_dir, tmp_path, case):
    from photon_core import load_model

    d = _copy(fast_dir, tmp_path / case)
    edit, words = BROKEN_WEIGHTS[case]
    edit(d)
    with pytest.raises(WeightsError) as e:
        load_model(str(d), progress=False)
    msg = str(e.value)
    assert str(d / "model.safetensors") in msg and words in msg and "\n" not in msg


BAD_CONFIGS = {
    "not_json": (b"{'text': ", "not valid JSON"),
    "binary": (b"\xff\xfe\x00garbage", "config.json"),
    "list": (b"[1, 2]", "expected a JSON object"),
    "section_not_dict": (b'{"text": 5}', "text must be an object"),
    "string_dim": (b'{"text": {"dim": "128"}}', "text.dim must be an integer"),
    "zero_heads": (b'{"text": {"n_heads": 0}}', "text.n_heads"),
    "negative": (b'{"vision": {"crop_size": -1}}', "vision.crop_size"),
    "huge": (b'{"text": {"max_context": 100000000000}}', "text.max_context"),
    "unknown_field": (b'{"text": {"dimm": 3}}', "unknown text fields"),
    "bool": (b'{"region": {"dim": true}}', "region.dim"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_json_names_the_file(fast_dir, tmp_path, case):
    from photon_core import load_model

    d = _copy(fast_dir, tmp_path / case)
    body, words = BAD_CONFIGS[case]
    (d / "config.json").write_bytes(body)
    with pytest.raises(ValueError) as e:
        load_model(str(d), progress=False)
    assert str(d / "config.json") in str(e.value) and words in str(e.value), str(e.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                              st.text(max_size=10)),
                    lambda c: st.one_of(st.lists(c, max_size=3),
                                        st.dictionaries(st.sampled_from(
                                            ["text", "vision", "region", "tokenizer", "config",
                                             "dim", "n_heads", "crop_size", "templates",
                                             "max_context", "eos_id"]), c, max_size=4)),
                    max_leaves=12))
def test_any_config_dict_loads_or_says_why(d):
    from photon_core.moondream import MoondreamConfig

    try:
        MoondreamConfig.from_dict(d if isinstance(d, dict) else {"text": d})
    except ValueError as e:
        assert str(e)


def test_bad_tokenizer_names_the_file(fast_dir, tmp_path):
    from photon_core import load_model

    d = _copy(fast_dir, tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_model(str(d), progress=False)


@pytest.mark.parametrize("device", ["potato", "cuda:99", "", "meta", "cpu:0:0"])
def test_bad_devices(fast_dir, device):
    from photon_core import load_model

    with pytest.raises(ValueError, match="device"):
        load_model(str(fast_dir), device=device, progress=False)


@pytest.mark.parametrize("spec", ["", "a" * 5000, "x\x00y", "not/a/real repo id!"])
def test_bad_model_specs(spec):
    from photon_core import load_model

    with pytest.raises(ValueError):
        load_model(spec, progress=False)


def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PHOTON_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "photon_core.cli", *args], capture_output=True,
                          text=True, env=env, timeout=180)


def test_cli_errors_are_one_line(fast_dir, tmp_path, image):
    """The new user's list: pickle renamed .safetensors, bad config.json, --device potato, and
    the random test model notice."""
    from PIL import Image

    Image.fromarray(image).save(tmp_path / "img.png")
    pk = _copy(fast_dir, tmp_path / "pk")
    _pickle(pk)
    cfg = _copy(fast_dir, tmp_path / "cfg")
    (cfg / "config.json").write_text("{oops")
    cases = [(["--model", str(pk)], str(pk / "model.safetensors")),
             (["--model", str(cfg)], str(cfg / "config.json")),
             (["--model", str(fast_dir), "--device", "potato"], "potato")]
    for extra, words in cases:
        r = _cli("detect", "--image", str(tmp_path / "img.png"), "--object", "cup", *extra)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and words in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    ok = _cli("point", "--image", str(tmp_path / "img.png"), "--object", "cup", "--model",
              str(fast_dir))
    assert ok.returncode == 0, ok.stderr
    assert "random test model" in ok.stderr and "random test model" in json.loads(ok.stdout)["test_model"]


def test_make_test_model_file_modes(tmp_path):
    from photon_core.moondream.test_model import make_test_model

    d = make_test_model(tmp_path / "m", fast=True)
    modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_no_unsafe_loaders_in_the_sources():
    """Security: weights only through safetensors, no remote code, no unsafe YAML/pickle. A
    static guard over every photon_core / photon_ros source file (a method such as
    `module.eval()` is not the builtin eval)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    unsafe = re.compile(r"torch\.load\(|pickle\.loads?\(|trust_remote_code\s*=\s*True|"
                        r"yaml\.load\(|yaml\.unsafe_load|np\.load\([^)]*allow_pickle=True|"
                        r"(?<![.\w])eval\(|(?<![.\w])exec\(|torch\.hub\.load|from_pretrained\(")
    hits = []
    for pkg in ("photon_core", "photon_ros"):
        for f in (root / pkg).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if unsafe.search(line.split("#")[0]):
                    hits.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
