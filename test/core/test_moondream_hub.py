"""Loading by Hugging Face repo id, offline, from a local Hub cache laid out as huggingface_hub
writes it (no network here): revision refs, the tokenizer from moondream/starmie-v1 (as the
reference does), an optional config.json."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from photon_core import Task, load_model


def _cache_repo(cache, repo_id: str, files: dict, revision: str = "main", commit: str = "a" * 40):
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    for name, src in files.items():
        shutil.copy(src, snap / name)


@pytest.fixture
def hub_cache(tmp_path, fast_dir, monkeypatch):
    cache = tmp_path / "hub"
    # The model repo carries a decoy tokenizer.json that must not be used.
    decoy = tmp_path / "decoy.json"
    decoy.write_text("not a tokenizer")
    _cache_repo(cache, "acme/tiny-moondream", {"model.safetensors": fast_dir / "model.safetensors",
                                               "config.json": fast_dir / "config.json",
                                               "tokenizer.json": decoy})
    _cache_repo(cache, "acme/tiny-moondream", {"model.safetensors": fast_dir / "model.safetensors"},
                revision="v2", commit="b" * 40)
    _cache_repo(cache, "moondream/starmie-v1", {"tokenizer.json": fast_dir / "tokenizer.json"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_offline_from_cache_matches_folder(hub_cache, fast_dir, image):
    by_id = load_model("acme/tiny-moondream", progress=False)
    by_dir = load_model(str(fast_dir), progress=False)
    task = Task("detect", object="person", max_objects=3)
    assert by_id.run(by_id.encode_image(image), task).output == \
        by_dir.run(by_dir.encode_image(image), task).output


def test_revision_without_config_uses_defaults_of_the_cached_files(hub_cache, fast_dir):
    # revision v2 has no config.json in the cache: the optional file is skipped, and the
    # tiny checkpoint then lacks tensors the Moondream 2 defaults need: a clear error.
    with pytest.raises(ValueError, match="missing tensor"):
        load_model("acme/tiny-moondream", revision="v2", progress=False)


def test_unknown_repo_offline_names_hf_hub_offline(hub_cache):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        load_model("acme/nothing-here", progress=False)
