"""The Gemma 4 reference engine through the family contract: loading and its errors,
query/caption runs, streaming, cancel, reuse of one encoded image, seeded sampling,
refusal of detect/point at start, context limits."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from photon_core import task as task_mod
from photon_core.models import gemma4
from photon_core.models.gemma4 import load_model, make_test_model
from photon_core.models.gemma4.config import ConfigError
from photon_core.models.gemma4.weights import WeightsError
from photon_core.task import Task, TaskError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_test_model(tmp_path_factory.mktemp("g4e"), seed=1)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(str(ckpt), max_soft_tokens=70)


@pytest.fixture(scope="module")
def enc(model):
    img = np.random.default_rng(5).integers(0, 256, (36, 30, 3), dtype=np.uint8)
    return model.encode_image(img)


def test_family_contract():
    assert gemma4.FAMILY == "gemma4" and gemma4.MODEL_TYPES == ("gemma4",)
    assert gemma4.SKILLS == frozenset({"query", "caption"})
    assert gemma4.SKILLS <= set(task_mod.SKILLS)


def test_kv_sharing_layout(model, enc):
    t = model.config.text
    assert [t.kv_source(i) for i in range(t.n_layers)] == [0, 1, 2, 3, 3, 2]
    assert enc.cache.k[4] is None and enc.cache.k[5] is None and enc.cache.k[3] is not None
    assert "language_model.layers.4.self_attn.k_proj.weight" not in model.weights
    assert enc.cache.k[2].shape[-1] == 2 * enc.cache.k[0].shape[-1]      # wider global heads


def test_soft_token_budget_from_processor_config(ckpt, tmp_path):
    folder = tmp_path / "budget"
    shutil.copytree(ckpt, folder)
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"max_soft_tokens": 140}}))
    assert load_model(str(folder)).max_soft_tokens == 140
    with pytest.raises(ValueError, match="max_soft_tokens 100"):
        load_model(str(folder), max_soft_tokens=100)


def test_fits_the_scheduler_protocol(model, enc):
    from photon_core.scheduler.engine import (EngineLike, count_prompt_tokens, encoded_crops,
                                              step_batch)
    assert isinstance(model, EngineLike)
    t = Task("query", question="What color is the cup?", max_tokens=3)
    assert count_prompt_tokens(model, t) == len(model.prompter.task_tail("query", t.question))
    assert encoded_crops(enc) == 1
    runs = [model.start(enc, t, ignore_eos=True), model.start(enc, Task("caption", max_tokens=2),
                                                              ignore_eos=True)]
    assert step_batch(model, runs) == [True, True]
    assert step_batch(model, runs) == [True, False]


def test_query_streams_the_answer(model, enc):
    deltas = []
    res = model.run(enc, Task("query", question="What color is the cup?", max_tokens=20),
                    stream=deltas.append)
    assert res.output.keys() == {"answer"} and isinstance(res.output["answer"], str)
    assert "".join(deltas) == res.output["answer"]
    assert res.finish_reason in ("stop", "length") and 1 <= res.tokens <= 20
    assert res.engine_ms >= res.timings["encode_ms"] > 0


@pytest.mark.parametrize("length", ["short", "normal", "long"])
def test_caption_lengths(model, length):
    tail = model.prompter.task_tail("caption", length)
    assert model.prompter.decode(tail).strip().startswith("Describe this image")
    assert model.caption(np.zeros((24, 24, 3), np.uint8), length, max_tokens=3).keys() == {"caption"}


def test_one_encoding_serves_many_tasks(model, enc):
    t = Task("query", question="Is there a bottle?", max_tokens=8)
    first = model.run(enc, t).output
    model.run(enc, Task("caption", max_tokens=5))
    assert model.run(enc, t).output == first


def test_seeded_sampling_repeats(model, enc):
    t = Task("query", question="How many people?", max_tokens=10, temperature=1.0, seed=7)
    assert model.run(enc, t).output == model.run(enc, t).output


def test_step_cancel_and_result(model, enc):
    run = model.start(enc, Task("query", question="What is it?", max_tokens=50), ignore_eos=True)
    assert run.step() and run.step()
    with pytest.raises(RuntimeError):
        run.result()
    run.cancel("deadline")
    assert not run.step()
    res = run.result()
    assert res.finish_reason == "deadline" and res.tokens == 2


def test_runs_to_max_tokens(model, enc):
    run = model.start(enc, Task("caption", max_tokens=6), ignore_eos=True)
    while run.step():
        pass
    assert run.result().finish_reason == "length" and run.result().tokens == 6


@pytest.mark.parametrize("skill", ["detect", "point"])
def test_detect_point_refused_at_start(model, skill):
    with pytest.raises(TaskError, match=f"does not support {skill}"):
        model.start(np.zeros((8, 8, 3), np.uint8), Task(skill, object="person"))


def test_context_limit(ckpt):
    small = load_model(str(ckpt), max_soft_tokens=70, max_context=80)
    enc = small.encode_image(np.zeros((24, 24, 3), np.uint8))
    with pytest.raises(TaskError, match="does not fit"):
        small.start(enc, Task("query", question="What?", max_tokens=100))


def test_errors_are_clear(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5"}))
    with pytest.raises(ConfigError, match="model_type is 'qwen3_5'"):
        load_model(str(bad))
    moe = {**cfg, "text_config": {**cfg["text_config"], "enable_moe_block": True}}
    (bad / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ConfigError, match="MoE"):
        load_model(str(bad))
    wider = {**cfg, "text_config": {**cfg["text_config"], "hidden_size": 96}}
    (bad / "config.json").write_text(json.dumps(wider))
    with pytest.raises(WeightsError, match="has shape"):
        load_model(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    next(bad.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightsError, match="lists shards that are not in"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="not found"):
        load_model(str(tmp_path / "nowhere"))


def test_single_file_checkpoint_loads(ckpt, tmp_path):
    """model.safetensors without an index (one shard) gives the same model."""
    from safetensors.torch import load_file, save_file
    one = tmp_path / "one"
    shutil.copytree(ckpt, one)
    tensors = {}
    for f in sorted(one.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (one / "model.safetensors.index.json").unlink()
    save_file(tensors, str(one / "model.safetensors"))
    a, b = load_model(str(ckpt)), load_model(str(one))
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def test_per_layer_table_on_cpu_option(ckpt):
    """ple_on_cpu=True keeps the per-layer embedding table in host memory (on a GPU: the
    other weights on the device, test_gemma4_gpu.py); the answers are the same."""
    from photon_core.models.gemma4.weights import PER_LAYER_TABLE
    m = load_model(str(ckpt), max_soft_tokens=70, ple_on_cpu=True)
    assert m.weights[PER_LAYER_TABLE].device.type == "cpu"
    ref = load_model(str(ckpt), max_soft_tokens=70)
    ids = [2, 40, 41, 42, 43]
    a, b = m.greedy(ids, 3), ref.greedy(ids, 3)
    assert a[1] == b[1] and torch.equal(a[0], b[0])
