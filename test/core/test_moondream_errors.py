"""Bad inputs give clear errors that name the problem."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from photon_core import Task, TaskError
from photon_core.moondream import ImageError, WeightsError


@pytest.mark.parametrize("bad,message", [
    ("/nonexistent/frame.png", "not found"),
    (np.zeros((20, 30), np.uint8), "HxWx3"),
    (np.zeros((20, 30, 4), np.uint8), "HxWx3"),
    (np.zeros((20, 30, 3), np.float32), "uint8"),
    (np.zeros((0, 30, 3), np.uint8), "empty"),
    (np.zeros((30, 0, 3), np.uint8), "empty"),
    (12345, "unsupported image type"),
])
def test_bad_images(fast_model, bad, message):
    with pytest.raises(ImageError, match=message):
        fast_model.encode_image(bad)


def test_unreadable_file(fast_model, tmp_path):
    p = tmp_path / "broken.jpg"
    p.write_bytes(b"not an image")
    with pytest.raises(ImageError, match="cannot read image"):
        fast_model.encode_image(p)


@pytest.mark.parametrize("task,message", [
    (Task("segment", object="x"), "unknown skill"),
    (Task("query", question="   "), "non-empty question"),
    (Task("detect"), "non-empty object"),
    (Task("caption", caption_length="epic"), "caption length"),
])
def test_bad_tasks(fast_model, image, task, message):
    with pytest.raises(TaskError, match=message):
        fast_model.run(image, task)


def test_prompt_longer_than_context(fast_model, image):
    question = "猫" * 300     # < MAX_QUESTION_CHARS chars, > 256 tokens of context (3 bytes each)
    with pytest.raises(TaskError, match="does not fit"):
        fast_model.run(image, Task("query", question=question))


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_missing_tensor_is_named(fast_dir, tmp_path):
    from photon_core import load_model

    d = _rewrite(fast_dir, tmp_path / "m", lambda t: t.pop("model.text.blocks.1.mlp.fc2.bias"))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) text\.blocks\.1\.mlp\.fc2\.bias"):
        load_model(str(d), progress=False)


def test_wrong_shape_is_named_with_shapes(fast_dir, tmp_path):
    from photon_core import load_model

    def edit(t):
        t["model.vision.patch_emb.weight"] = torch.zeros(32, 500)
    d = _rewrite(fast_dir, tmp_path / "m", edit)
    with pytest.raises(WeightsError, match=r"vision\.patch_emb\.weight has shape \(32, 500\), "
                                           r"expected \(32, 588\)"):
        load_model(str(d), progress=False)


def test_bad_model_locations(tmp_path):
    from photon_core import load_model

    with pytest.raises(ValueError, match="not found"):
        load_model(str(tmp_path / "nothing_here"), progress=False)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="no pickle"):
        load_model(str(tmp_path / "weights.bin"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path / "empty"), progress=False)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path / "empty"), dtype="int3", progress=False)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "photon_core.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_cli_make_test_model_and_detect(tmp_path, image):
    from PIL import Image

    made = _cli("make-test-model", "moondream2", str(tmp_path / "m"), "--seed", "2", "--fast")
    assert made.returncode == 0, made.stderr
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"model.safetensors", "config.json",
                                                             "tokenizer.json"}
    Image.fromarray(image).save(tmp_path / "img.png")
    out = _cli("detect", "--model", str(tmp_path / "m"), "--image", str(tmp_path / "img.png"),
               "--object", "person", "--max-objects", "3")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert isinstance(data["objects"], list) and len(data["objects"]) <= 3
    assert data["finish_reason"] in ("stop", "length")
    bad = _cli("query", "--model", str(tmp_path / "m"), "--image", str(tmp_path / "no.png"),
               "--question", "hi")
    assert bad.returncode == 2 and "image file not found" in bad.stderr
    offline = _cli("caption", "--model", "vikhyatk/moondream2", "--image",
                   str(tmp_path / "img.png"),
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE" in offline.stderr
