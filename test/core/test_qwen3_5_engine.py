"""Qwen 3.5 reference engine: the family contract, checkpoint loading and its errors, prefix
sharing (copy-on-start), streaming, cancel, grounding through a run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from photon_core.models import qwen3_5
from photon_core.models.qwen3_5 import CheckpointError, ConfigError
from photon_core.models.qwen3_5.run import TaskRun
from photon_core.task import Task, TaskResult


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen3_5.make_test_model(tmp_path_factory.mktemp("q35e"), seed=5)


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen3_5.load_model(str(ckpt))


@pytest.fixture
def frame():
    return np.random.default_rng(2).integers(0, 256, (96, 128, 3), dtype=np.uint8)


def test_family_contract():
    assert qwen3_5.FAMILY == "qwen3.5"
    assert "qwen3_5" in qwen3_5.MODEL_TYPES
    assert qwen3_5.SKILLS == {"query", "caption", "detect", "point"}
    assert callable(qwen3_5.load_model) and callable(qwen3_5.make_test_model)


def test_sharded_checkpoint_loads_the_same_tensors(ckpt, model, tmp_path):
    sharded = qwen3_5.make_test_model(tmp_path / "sharded", seed=5, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    other = qwen3_5.load_model(str(sharded))
    assert other.weights.keys() == model.weights.keys()
    for k, v in model.weights.items():
        assert torch.equal(v, other.weights[k]), k


def _copy(ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    return d


def test_load_errors(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        qwen3_5.load_model(str(tmp_path / "nope"))
    d = _copy(ckpt, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        qwen3_5.load_model(str(d))
    shutil.rmtree(d)

    d = _copy(ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gemma4"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type"):
        qwen3_5.load_model(str(d))
    cfg["model_type"] = "qwen3_5"
    cfg["text_config"]["hidden_size"] = 80
    cfg["vision_config"]["out_hidden_size"] = 80
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        qwen3_5.load_model(str(d))
    del cfg["text_config"]["head_dim"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="head_dim"):
        qwen3_5.load_model(str(d))
    shutil.rmtree(d)

    d = _copy(ckpt, tmp_path)
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t.pop("model.language_model.layers.1.linear_attn.A_log")
    t["mtp.layers.0.extra.weight"] = torch.zeros(2)         # extra tensors are ignored
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="A_log"):
        qwen3_5.load_model(str(d))
    (d / "chat_template.jinja").unlink()
    t["model.language_model.layers.1.linear_attn.A_log"] = torch.zeros(4)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="chat template"):
        qwen3_5.load_model(str(d))


def test_prefix_is_shared_copy_on_start(model, frame):
    enc = model.encode_image(frame)
    snapshot = {k: v.clone() for k, v in {**enc.state.recurrent, **enc.state.conv}.items()}
    k_snap = {k: v.clone() for k, v in enc.state.k.items()}
    tasks = [Task("query", question="What color is the cup?", max_tokens=12),
             Task("caption", caption_length="short", max_tokens=10)]
    alone = [model.run(enc, t) for t in tasks]
    runs = [model.start(enc, t) for t in tasks]
    while any(model.step_batch(runs)):
        pass
    both = [r.result() for r in runs]
    assert [r.output for r in both] == [r.output for r in alone]
    for k, v in {**enc.state.recurrent, **enc.state.conv}.items():
        assert torch.equal(v, snapshot[k])
    for k, v in enc.state.k.items():
        assert torch.equal(v, k_snap[k])
    # and the same as encoding again
    again = model.run(model.encode_image(frame), tasks[0])
    assert again.output == alone[0].output


def test_streaming_cancel_and_result(model, frame):
    enc = model.encode_image(frame)
    deltas = []
    res = model.run(enc, Task("query", question="Describe the image.", max_tokens=20),
                    stream=deltas.append)
    assert isinstance(res, TaskResult) and "".join(deltas) == res.output["answer"]
    assert res.tokens <= 20 and res.finish_reason in ("stop", "length")
    r = model.start(enc, Task("caption", max_tokens=50), ignore_eos=True)
    with pytest.raises(RuntimeError):
        r.result()
    r.step()
    r.cancel("deadline")
    assert not r.step()
    assert r.result().finish_reason == "deadline" and r.result().tokens == 1
    res = model.run(enc, Task("caption", max_tokens=50), should_stop=lambda: "cancelled")
    assert res.finish_reason == "cancelled" and res.tokens == 0


def test_detect_and_point_parse_the_generated_json(model, frame, monkeypatch):
    enc = model.encode_image(frame)
    answer = '[{"bbox_2d": [100, 200, 300, 400], "label": "cup"}]'
    script = model.prompts.encode(answer) + [model.prompts.tok.token_to_id("<|im_end|>")]

    def scripted(self, ids):
        self._i = getattr(self, "_i", -1) + 1
        return script[self._i]
    monkeypatch.setattr(TaskRun, "_forward", scripted)
    out = model.run(enc, Task("detect", object="cup"))
    assert out.output == {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4}]}
    assert out.finish_reason == "stop"
    out = model.run(enc, Task("point", object="cup"))
    assert out.output["points"] == [pytest.approx({"x": 0.2, "y": 0.3})]

    before = model.stats["grounding_parse_errors"]
    script[:] = model.prompts.encode("no json here") + [script[-1]]
    assert model.run(enc, Task("detect", object="cup")).output == {"objects": []}
    assert model.stats["grounding_parse_errors"] == before + 1


def test_random_model_detect_never_crashes(model, frame):
    res = model.run(frame, Task("detect", object="person", max_objects=1))
    assert isinstance(res.output["objects"], list)


def test_bad_inputs(model):
    from photon_core.models.qwen3_5._shared import ImageError
    with pytest.raises(ImageError):
        model.encode_image(np.zeros((10, 10), np.uint8))
    with pytest.raises(ValueError):
        model.start(np.zeros((40, 40, 3), np.uint8), Task("query", question=""))


def test_vision_grid_tables_kept_per_grid(model):
    """The encode keeps each grid's position table and rotary (vision.grid_tables) and
    reuses them: the tower's output with the kept tables is vision.encode's without them,
    bit for bit, and a second frame of the grid makes no new ones."""
    from photon_core.models.qwen3_5 import vision
    from photon_core.models.qwen3_5.image_processor import preprocess
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(2)]
    model._grid_tables.values.clear()
    encs = [model.encode_image(f) for f in frames]
    assert len(model._grid_tables) == 1
    tables = next(iter(model._grid_tables.values.values()))
    patches, grid = preprocess(frames[1], model.image_config)
    p = torch.from_numpy(patches)
    cfg = model.config.vision
    assert torch.equal(vision.encode(model.weights, cfg, p, grid, tables),
                       vision.encode(model.weights, cfg, p, grid))
    assert len(encs) == 2 and len(model._grid_tables) == 1


def test_grounding_ends_at_the_max_objects_th_entry(model, frame, monkeypatch):
    """A detect answer listing more entries than max_objects ends at the token that closes
    the max_objects-th usable one (finish "length", no parse error counted); fewer entries
    run to the stop token as before."""
    enc = model.encode_image(frame)
    boxes = [[100, 200, 300, 400], [500, 100, 600, 300], [0, 0, 10, 10]]
    answer = "```json\n" + json.dumps([{"bbox_2d": b, "label": 'a "}" cup'}
                                       for b in boxes]) + "\n```"
    ids = model.prompts.encode(answer)
    script = ids + [model.prompts.tok.token_to_id("<|im_end|>")]

    def scripted(self, _ids):
        self._i = getattr(self, "_i", -1) + 1
        return script[self._i]
    monkeypatch.setattr(TaskRun, "_forward", scripted)
    before = model.stats["grounding_parse_errors"]
    out = model.run(enc, Task("detect", object="cup", max_objects=2))
    assert out.finish_reason == "length" and len(out.output["objects"]) == 2
    assert out.output["objects"][1] == {"x_min": 0.5, "y_min": 0.1, "x_max": 0.6, "y_max": 0.3}
    assert model.stats["grounding_parse_errors"] == before
    # the tokens up to the one that closes the second entry, none after it
    text = model.prompts.decode(ids[:out.tokens])
    assert text.rstrip().endswith("}") and text.count("bbox_2d") == 2
    assert len(model.prompts.decode(ids[:out.tokens - 1])) < len(text)
    out = model.run(enc, Task("detect", object="cup", max_objects=3))
    assert out.finish_reason == "length" and len(out.output["objects"]) == 3
    out = model.run(enc, Task("detect", object="cup", max_objects=4))
    assert out.finish_reason == "stop" and len(out.output["objects"]) == 3
    assert out.tokens == len(ids)
