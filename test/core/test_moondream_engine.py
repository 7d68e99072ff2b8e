"""The engine on tiny random checkpoints: caching, reuse, determinism, step API, loading."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core import Task, TaskResult
from photon_core.moondream import text, vision
from photon_core.moondream.crops import overlap_crops
from photon_core.moondream.kv_cache import KVCache


def _image_tokens(model, img):
    v, w = model.config.vision, model.weights
    crops, tiling = overlap_crops(img, v.crop_size, v.enc_patch_size, v.overlap_margin,
                                  v.max_crops)
    feats = vision.encoder(w, v, vision.normalize(crops, w.device, w.dtype))
    return vision.project(w, v, feats, tiling)


@torch.inference_mode()
def test_kv_cache_decoding_equals_full_recompute(fast_model, images):
    m, w, t = fast_model, fast_model.weights, fast_model.config.text
    img = images[1]   # 200x90: a (2, 1) tiling with the fast config
    run = m.start(m.encode_image(img), Task("query", question="What is it?", max_tokens=12),
                  ignore_eos=True)
    tokens, step_logits = [run.next_token], [text.lm_head(w, run.hidden[0, 0])]
    while run.step():
        tokens.append(run.next_token)
        step_logits.append(text.lm_head(w, run.hidden[0, 0]))
    assert len(tokens) == 12

    prompt = m.tokenizer.prompt("query", "What is it?")
    bos = text.embed(w, torch.tensor([0]))
    seq = torch.cat([bos, _image_tokens(m, img), text.embed(w, torch.tensor(prompt + tokens[:-1]))])
    cache = KVCache(t.n_layers, t.n_kv_heads, seq.shape[0], t.head_dim, "cpu", w.dtype)
    hidden = text.decoder(w, t, seq[None], 0, cache, m.prefix_len)
    first = m.prefix_len + len(prompt) - 1
    full_logits = text.lm_head(w, hidden[0, first:])
    torch.testing.assert_close(torch.stack(step_logits), full_logits, atol=1e-4, rtol=1e-4)


def test_prefix_is_bidirectional_rest_causal():
    mask = text.attention_mask(0, 6, 3, "cpu")
    assert mask[0, 2] and mask[1, 2]          # prefix tokens see later prefix tokens
    assert not mask[0, 3] and not mask[3, 4]  # nothing sees past tokens after the prefix
    assert mask[5].all()


def test_encoded_image_reused_across_tasks_equals_reencoding(fast_model, image):
    m = fast_model
    tasks = [Task("detect", object="person"), Task("query", question="What is it?"),
             Task("point", object="cup"), Task("caption", caption_length="short")]
    enc = m.encode_image(image)
    shared = [m.run(enc, t).output for t in tasks] + [m.run(enc, tasks[0]).output]
    fresh = [m.run(m.encode_image(image), t).output for t in tasks + tasks[:1]]
    assert shared == fresh
    assert shared[0] == shared[-1]


def test_loops_are_exercised_and_outputs_normalized(fast_model, images):
    m = fast_model
    counts = []
    for img in images:
        enc = m.encode_image(img)
        det = m.run(enc, Task("detect", object="person", max_objects=20))
        pts = m.run(enc, Task("point", object="cup", max_objects=20))
        counts += [len(det.output["objects"]), len(pts.output["points"])]
        for o in det.output["objects"]:
            assert set(o) == {"x_min", "y_min", "x_max", "y_max"}
            assert 0 <= (o["x_min"] + o["x_max"]) / 2 < 1 and o["x_max"] > o["x_min"]
        for p in pts.output["points"]:
            assert 0 <= p["x"] < 1 and 0 <= p["y"] < 1
        assert det.tokens == 3 * len(det.output["objects"])
        assert pts.tokens == 2 * len(pts.output["points"])
    assert max(counts) > 0


def test_greedy_is_deterministic_and_seeded_sampling_repeats(fast_model, image):
    m = fast_model
    enc = m.encode_image(image)
    for task in (Task("detect", object="car"), Task("query", question="What is it?"),
                 Task("caption", temperature=0.8, top_p=0.9, seed=11, max_tokens=16)):
        assert m.run(enc, task).output == m.run(enc, task).output


def test_streaming_deltas_make_the_answer(fast_model, image):
    deltas = []
    res = fast_model.run(image, Task("query", question="What is it?", max_tokens=20),
                         stream=deltas.append)
    assert "".join(deltas) == res.output["answer"]
    out = fast_model.query(image, "What is it?", max_tokens=20)
    assert out == res.output


def test_step_api_cancel_and_should_stop(fast_model, image):
    m = fast_model
    enc = m.encode_image(image)
    run = m.start(enc, Task("caption", max_tokens=30), ignore_eos=True)
    assert run.step() and run.step()
    partial = run.text_so_far
    run.cancel("deadline")
    res = run.result()
    assert res.finish_reason == "deadline" and res.output["caption"] == partial
    assert res.tokens == 2 and not run.step()
    res = m.run(enc, Task("detect", object="person", max_objects=20),
                should_stop=lambda: "cancelled")
    assert res.finish_reason in ("cancelled", "stop") and res.tokens == 0
    assert isinstance(res, TaskResult)
    assert {"encode_ms", "prefill_ms", "decode_ms"} <= set(res.timings)
    assert res.engine_ms >= res.timings["prefill_ms"]


def test_step_batch_equals_one_by_one(fast_model, images):
    m = fast_model
    tasks = [Task("detect", object="person"), Task("query", question="What?", max_tokens=10)]
    encs = [m.encode_image(i) for i in images[:2]]
    runs = [m.start(e, t) for e, t in zip(encs, tasks)]
    while any(m.step_batch(runs)):
        pass
    assert [r.result().output for r in runs] == [m.run(e, t).output for e, t in zip(encs, tasks)]


def test_max_limits(fast_model, images):
    m = fast_model
    for img in images:
        res = m.run(img, Task("detect", object="person", max_objects=1))
        assert len(res.output["objects"]) <= 1
        assert res.finish_reason == "stop" or len(res.output["objects"]) == 1
        q = m.run(img, Task("query", question="What is it?", max_tokens=2))
        assert q.tokens <= 2
    enc = m.encode_image(images[0])
    run = m.start(enc, Task("detect", object="person", max_objects=2), ignore_eos=True)
    forwards = []
    inner = run._forward
    run._forward = lambda emb: (forwards.append(1), inner(emb))
    while run.step():
        pass
    res = run.result()
    assert (len(res.output["objects"]), res.tokens, res.finish_reason) == (2, 6, "length")
    # the step that completes the last allowed object feeds nothing: 5 forwards, not 6
    assert len(forwards) == 5
    run = m.start(enc, Task("query", question="What?", max_tokens=5), ignore_eos=True)
    while run.step():
        pass
    assert (run.result().tokens, run.result().finish_reason) == (5, "length")


def test_inputs_pil_path_and_numpy_agree(fast_model, image, tmp_path):
    from PIL import Image

    path = tmp_path / "x.png"
    Image.fromarray(image).save(path)
    task = Task("detect", object="person")
    outs = [fast_model.run(fast_model.encode_image(x), task).output
            for x in (image, Image.fromarray(image), str(path), path)]
    assert all(o == outs[0] for o in outs)


def test_huge_image_is_shrunk_not_materialized(fast_model):
    huge = np.broadcast_to(np.uint8(90), (16000, 16000, 3))   # 768 MB if copied
    enc = fast_model.encode_image(huge)
    assert max(enc.width, enc.height) <= fast_model.max_image_side
    assert fast_model.run(enc, Task("point", object="cup", max_objects=2)).finish_reason


def test_bf16_loads_and_runs_on_cpu(fast_dir, image):
    from photon_core import load_model

    m = load_model(str(fast_dir), dtype="bf16", progress=False)
    assert m.weights["text.wte"].dtype == torch.bfloat16
    enc = m.encode_image(image)
    assert enc.kv.dtype == torch.bfloat16
    for task in (Task("detect", object="person", max_objects=3), Task("point", object="cup", max_objects=3),
                 Task("query", question="What?", max_tokens=4), Task("caption", max_tokens=4)):
        assert m.run(enc, task).finish_reason in ("stop", "length")


def test_old_layout_loads_like_new_layout(tmp_path, image):
    from photon_core import load_model
    from photon_core.moondream.test_model import make_test_model
    from safetensors import safe_open

    new = load_model(str(make_test_model(tmp_path / "new", seed=4, fast=True)), progress=False)
    old_dir = make_test_model(tmp_path / "old", seed=4, fast=True, old_layout=True)
    with safe_open(str(old_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "text_model.transformer.h.0.mixer.Wqkv.weight" in names
        assert f.get_tensor("region_model.coordinate_features.weight").shape == (16, 1)
    old = load_model(str(old_dir), progress=False)
    assert set(old.weights) == set(new.weights)
    for k in new.weights:
        assert torch.equal(old.weights[k], new.weights[k]), k
    task = Task("detect", object="person")
    assert old.run(image, task).output == new.run(image, task).output
