"""Fidelity against the reference implementation (vikhyat/moondream, moondream/torch/).

Runs only when PHOTON_MOONDREAM_REF points at a checkout of that repository (outside this
repo). Both implementations load the same tiny random checkpoint written by
`make_test_model`; the reference runs in fp32 (its crops are cast to bf16 by default; the
test feeds it fp32 crops made by its own overlap_crop_image) with our tokenizer.json in place
of the Hub tokenizer it would download. The bf16 tests load both in bf16 (the reference in its
own bf16 mode) and require bit-identical image k/v, prompt logits and greedy outputs.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REF = os.environ.get("PHOTON_MOONDREAM_REF")
pytestmark = pytest.mark.skipif(not REF, reason="set PHOTON_MOONDREAM_REF to a reference checkout")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from photon_core.moondream import load_model
    from photon_core.moondream.test_model import make_test_model

    sys.path.insert(0, REF)
    import json

    from tokenizers import Tokenizer
    from moondream.torch import moondream as ref_md
    from moondream.torch.config import MoondreamConfig as RefConfig
    from moondream.torch.image_crops import overlap_crop_image
    from moondream.torch.weights import load_weights_into_model

    path = make_test_model(tmp_path_factory.mktemp("tiny"), seed=3)
    ours = load_model(str(path), progress=False)

    class LocalTokenizer:
        @staticmethod
        def from_pretrained(name):
            return Tokenizer.from_file(str(path / "tokenizer.json"))

    def prepare_crops_fp32(image, config, device):
        out = overlap_crop_image(np.array(image.convert("RGB")), max_crops=config.max_crops,
                                 overlap_margin=config.overlap_margin)
        crops = torch.from_numpy(out["crops"]).permute(0, 3, 1, 2).float()
        return ((crops / 255.0 - 0.5) / 0.5).to(device), out["tiling"]

    mp = pytest.MonkeyPatch()
    mp.setattr(ref_md, "Tokenizer", LocalTokenizer)
    mp.setattr(ref_md, "prepare_crops", prepare_crops_fp32)
    cfg = RefConfig.from_dict(json.loads((path / "config.json").read_text()))
    ref = ref_md.MoondreamModel(cfg, dtype=torch.float32)
    load_weights_into_model(str(path / "model.safetensors"), ref)
    ref.eval()
    yield ours, ref
    mp.undo()


def _images(sizes=((120, 160), (480, 640), (300, 90))):
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_image_tokens_and_prompt_logits_match(pair):
    from photon_core.moondream import text, vision
    from photon_core.moondream.crops import overlap_crops
    from photon_core.task import Task

    ours, ref = pair
    for img in _images():
        v = ours.config.vision
        crops, tiling = overlap_crops(np.asarray(img), v.crop_size, v.enc_patch_size,
                                      v.overlap_margin, v.max_crops)
        with torch.inference_mode():
            feats = vision.encoder(ours.weights, v, vision.normalize(crops, "cpu", torch.float32))
            mine = vision.project(ours.weights, v, feats, tiling)
            theirs = ref._run_vision_encoder(img)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)

        enc = ours.encode_image(img)
        run = ours.start(enc, Task("detect", object="person"))
        with torch.inference_mode():
            my_logits = text.lm_head(ours.weights, run.hidden[0, 0])
            ref_enc = ref.encode_image(img)
            ref.load_encoded_image(ref_enc)
            prompt = torch.tensor([ours.tokenizer.prompt("detect", "person")])
            ref_logits, _, _, _ = ref._prefill_prompt(prompt, ref_enc.pos, 0, 0)
        assert torch.equal(my_logits, ref_logits[0])     # bit for bit (same attention extent)


def _assert_same_greedy(ours, ref, img, caption_lengths) -> None:
    """Greedy detect/point/query/caption of ours and the reference on one image: identical."""
    from photon_core.task import Task, clamp_objects

    enc = ours.encode_image(img)
    ref_enc = ref.encode_image(img)   # (passing settings with an image trips the reference)
    for skill, obj, limit in (("detect", "person", 12), ("point", "cup", 12),
                              ("detect", "car", 1), ("point", "dog", 3)):
        mine = ours.run(enc, Task(skill, object=obj, max_objects=limit)).output
        theirs = getattr(ref, skill)(ref_enc, obj, settings={"max_objects": limit})
        # our contract clamps coordinates to 0..1 (photon_core.task.clamp_objects); inside
        # that range the floats are the reference's, bit for bit
        theirs = {k: clamp_objects(v) for k, v in theirs.items()}
        assert mine == theirs, (img.size, skill, obj)     # the same floats, bit for bit
    settings = {"temperature": 0, "max_tokens": 24}
    for question in ("What is it?", "Wie viele Äpfel? 猫"):
        mine = ours.run(enc, Task("query", question=question, max_tokens=24)).output
        assert mine["answer"] == ref.query(ref_enc, question, settings=settings)["answer"]
    for length in caption_lengths:
        mine = ours.run(enc, Task("caption", caption_length=length, max_tokens=24)).output
        assert mine["caption"] == ref.caption(ref_enc, length, settings=settings)["caption"]


def test_greedy_outputs_identical(pair):
    ours, ref = pair
    sizes = ((120, 160), (480, 640), (300, 90), (20, 20), (1080, 1920), (640, 360))
    for img in _images(sizes):
        _assert_same_greedy(ours, ref, img, ("short", "normal", "long"))


@pytest.fixture(scope="module")
def bf16_pair(pair):
    """Ours and the reference in bf16 on the same checkpoint. Tests using it put the
    reference in its own bf16 mode with _ref_bf16_crops (its unpatched prepare_crops: bf16
    pixel arithmetic)."""
    import json

    from photon_core.moondream import load_model

    sys.path.insert(0, REF)
    from moondream.torch import moondream as ref_md
    from moondream.torch.config import MoondreamConfig as RefConfig
    from moondream.torch.weights import load_weights_into_model

    path = pair[0].model_id
    ours = load_model(path, dtype="bf16", progress=False)
    cfg = RefConfig.from_dict(json.loads(open(f"{path}/config.json").read()))
    ref = ref_md.MoondreamModel(cfg, dtype=torch.bfloat16)
    load_weights_into_model(f"{path}/model.safetensors", ref)
    ref.eval()
    return ours, ref


def _ref_bf16_crops(monkeypatch):
    from moondream.torch import moondream as ref_md
    from moondream.torch import vision as ref_vision
    monkeypatch.setattr(ref_md, "prepare_crops", ref_vision.prepare_crops)   # the bf16 one


def test_bf16_vision_and_logits_are_bit_exact_with_the_reference(bf16_pair, monkeypatch):
    """bf16: image tokens, the image prefix k/v (the same rotary channel order) and the
    prompt logits identical to the reference's, bit for bit."""
    from photon_core.moondream import text, vision
    from photon_core.moondream.crops import overlap_crops
    from photon_core.task import Task

    ours, ref = bf16_pair
    _ref_bf16_crops(monkeypatch)
    for img in _images(((480, 640), (90, 300), (120, 160))):
        enc = ours.encode_image(img)
        v = ours.config.vision
        with torch.inference_mode():
            crops, tiling = overlap_crops(np.asarray(img), v.crop_size, v.enc_patch_size,
                                          v.overlap_margin, v.max_crops)
            feats = vision.encoder(ours.weights, v, vision.normalize(crops, "cpu",
                                                                     torch.bfloat16))
            assert torch.equal(vision.project(ours.weights, v, feats, tiling),
                               ref._run_vision_encoder(img))
            ref_enc = ref.encode_image(img)
            for i, (k, val) in enumerate(ref_enc.caches):
                assert torch.equal(enc.kv[i, 0], k) and torch.equal(enc.kv[i, 1], val), i
            ref.load_encoded_image(ref_enc)
            prompt = torch.tensor([ours.tokenizer.prompt("detect", "person")])
            ref_logits, _, _, _ = ref._prefill_prompt(prompt, ref_enc.pos, 0, 0)
            run = ours.start(enc, Task("detect", object="person"))
            mine = text.lm_head(ours.weights, run.hidden[0, 0])
        assert torch.equal(mine, ref_logits[0])


def test_bf16_greedy_outputs_identical(bf16_pair, monkeypatch):
    """bf16 on the CPU: greedy detect/point/query/caption identical to the reference's (this
    needs the reference's rotary channel order and attention extent: rope.py, text.py)."""
    ours, ref = bf16_pair
    _ref_bf16_crops(monkeypatch)
    for img in _images(((120, 160), (480, 640), (90, 300), (1080, 1920))):
        _assert_same_greedy(ours, ref, img, ("short", "normal"))


def test_tiling_matches_reference_everywhere():
    sys.path.insert(0, REF)
    from moondream.torch.image_crops import select_tiling as ref_select_tiling

    from photon_core.moondream.crops import select_tiling

    for h in range(1, 4000, 97):
        for w in range(1, 4000, 89):
            assert select_tiling(h, w, 266, 12) == ref_select_tiling(h, w, 266, 12), (h, w)
