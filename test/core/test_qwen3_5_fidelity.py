"""Qwen 3.5 reference path vs transformers' Qwen3_5ForConditionalGeneration (the oracle) on a
tiny random checkpoint in the real layout, fp32: prefill logits, then 16 greedy decode steps
(logits and tokens), for a text-only prompt (longer than one 64-token delta-rule chunk) and an
image + text prompt run through our engine (shared image prefix state + task prefill)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from photon_core.models import qwen3_5  # noqa: E402
from photon_core.models.qwen3_5 import decoder  # noqa: E402
from photon_core.models.qwen3_5.image_processor import preprocess  # noqa: E402
from photon_core.models.qwen3_5.state import HybridState  # noqa: E402
from photon_core.task import Task  # noqa: E402

ATOL = 2e-4
STEPS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen3_5.make_test_model(tmp_path_factory.mktemp("q35"), seed=3)


@pytest.fixture(scope="module")
def ours(ckpt):
    return qwen3_5.load_model(str(ckpt))


@pytest.fixture(scope="module")
def oracle(ckpt):
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(ckpt), dtype=torch.float32).eval()


def _oracle_greedy(oracle, **inputs):
    """-> (prefill logits [T, V], [(step logits [V], token)] * STEPS) with a cache."""
    with torch.no_grad():
        out = oracle(**inputs, use_cache=True)
        prefill = out.logits[0]
        cache, tok = out.cache if hasattr(out, "cache") else out.past_key_values, int(prefill[-1].argmax())
        steps = []
        for _ in range(STEPS):
            out = oracle(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            steps.append((out.logits[0, -1], tok))
            tok = int(out.logits[0, -1].argmax())
    return prefill, steps


def test_text_only_prefill_and_decode(ours, oracle):
    cfg = ours.config.text
    ids = torch.randint(10, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    ref_prefill, ref_steps = _oracle_greedy(oracle, input_ids=ids[None])

    w = ours.weights
    state = HybridState.empty(cfg, len(ids) + STEPS + 1, "cpu", torch.float32)
    hidden = decoder.forward(w, cfg, decoder.embed(w, ids),
                             decoder.text_positions(0, len(ids), "cpu"), state)
    prefill = decoder.logits(w, hidden)
    torch.testing.assert_close(prefill, ref_prefill, atol=ATOL, rtol=0)
    tok = int(prefill[-1].argmax())
    for i, (ref_logits, ref_tok) in enumerate(ref_steps):
        assert tok == ref_tok, f"step {i}"
        h = decoder.forward(w, cfg, decoder.embed(w, torch.tensor([tok])),
                            decoder.text_positions(len(ids) + i, 1, "cpu"), state)
        logits = decoder.logits(w, h[-1])
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        tok = int(logits.argmax())


@pytest.mark.parametrize("shape", [(120, 160), (90, 200)])
def test_image_prompt_through_the_engine(ours, oracle, shape):
    image = np.random.default_rng(shape[0]).integers(0, 256, (*shape, 3), dtype=np.uint8)
    enc = ours.encode_image(image)
    task = Task("query", question="What color is the cup?", max_tokens=STEPS)
    run = ours.start(enc, task, ignore_eos=True)

    # the same prompt for the oracle: prefix ids (image pads expanded) + the task's ids
    prompt = ours.prompts.task("query", task.question, enc.prefix_text)
    ids = torch.tensor([enc.state.tokens + prompt])
    patches, grid = preprocess(image, ours.image_config)
    mm = (ids == ours.config.image_token_id).int()
    assert int(mm.sum()) == grid[1] * grid[2] // 4
    ref_prefill, ref_steps = _oracle_greedy(
        oracle, input_ids=ids, pixel_values=torch.from_numpy(patches),
        image_grid_thw=torch.tensor([grid]), mm_token_type_ids=mm)

    assert run.next_token == int(ref_prefill[-1].argmax())
    logits_seen = []
    orig = decoder.logits

    def spy(w, h):
        out = orig(w, h)
        logits_seen.append(out)
        return out
    decoder.logits = spy
    try:
        while run.step():
            pass
    finally:
        decoder.logits = orig
    assert run.tokens == [t for _, t in ref_steps]
    for mine, (ref, _) in zip(logits_seen, ref_steps):
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)
    assert len(logits_seen) == STEPS - 1   # the last emitted token is not fed


def test_vision_tower_matches(ours, oracle):
    from photon_core.models.qwen3_5 import vision

    image = np.random.default_rng(7).integers(0, 256, (100, 130, 3), dtype=np.uint8)
    patches, grid = preprocess(image, ours.image_config)
    mine = vision.encode(ours.weights, ours.config.vision, torch.from_numpy(patches), grid)
    with torch.no_grad():
        ref = oracle.model.get_image_features(torch.from_numpy(patches),
                                              torch.tensor([grid])).pooler_output[0]
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)
