"""A task's prompt prefilled in the encode's own prefix pass (prefix_prefill.py prompt_rows,
batched_encode.encode_body's prompt, GraphedBatchEncoder.encode(prompt=), FastRun taking
engine.PromptPrefill): on the CPU with the tiny model, against the reference's prefill of
the prompt after the prefix (text.decoder into a KVCache) and the engine without it."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from photon_core.fast import FastEngine
from photon_core.fast.graphed_batch_encoder import PROMPT_ROWS
from photon_core.models.moondream2 import batched_encode, text
from photon_core.models.moondream2.kv_cache import KVCache
from photon_core.models.moondream2.prefix_prefill import prefill_prefix
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
from photon_core.ops import HAVE_TRITON
from photon_core.task import Task

INTERPRETED = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


def _reference(model, x, ids):
    """Per frame: the prefix through text.decoder, then the prompt after it (the reference
    path's two passes) -> (k/v [n_layers, 2, n, Hkv, P + T, D], prompt hidden [n, T, dim])."""
    t, w = model.config.text, model.weights
    P, T = model.prefix_len, ids.shape[1]
    kvs, hs = [], []
    for i in range(x.shape[0]):
        cache = KVCache(t.n_layers, t.n_kv_heads, t.max_context, t.head_dim, x.device,
                        x.dtype)
        text.decoder(w, t, x[i:i + 1], 0, cache, P)
        h = text.decoder(w, t, text.embed(w, ids[i:i + 1]), P, cache, P)
        kvs.append(cache.data[:, :, :, :, :P + T])
        hs.append(h)
    return torch.cat(kvs, dim=2), torch.cat(hs)


FORMS = [dict(), dict(fast=True, kernels=False)]
if INTERPRETED:
    FORMS.append(dict(fast=True, kernels=True))


@pytest.mark.parametrize("form", FORMS, ids=lambda f: "-".join(f"{k}={v}" for k, v in
                                                                f.items()) or "span")
def test_prefill_with_prompt_rows_is_the_prefix_then_the_prompt(model, form):
    """prompt_rows=T: the k/v of the prefix and the prompt and the prompt rows' hidden
    states are the reference's two passes' (fp32: close; the span form: the same math)."""
    t, w = model.config.text, model.weights
    P, T = model.prefix_len, 5
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, P, t.dim, generator=g)
    ids = torch.randint(0, t.vocab_size, (2, T), generator=g)
    ref_kv, ref_h = _reference(model, x, ids)
    kv = batched_encode.kv_buffer(model, 2, T)
    kv.fill_(float("nan"))
    with torch.inference_mode():
        h = prefill_prefix(w, t, torch.cat([x, text.embed(w, ids)], dim=1), kv, P,
                           prompt_rows=T, **form)
    assert h.shape == (2, T, t.dim) and not torch.isnan(kv).any()
    scale = ref_kv.abs().max().item()
    assert (kv - ref_kv).abs().max().item() <= 1e-5 * scale
    assert (h - ref_h).abs().max().item() <= 1e-5 * ref_h.abs().max().item()
    # padding after a shorter prompt changes none of the real rows (causal)
    kv2 = batched_encode.kv_buffer(model, 2, T + 3)
    pad = torch.cat([ids, torch.zeros(2, 3, dtype=ids.dtype)], dim=1)
    with torch.inference_mode():
        h2 = prefill_prefix(w, t, torch.cat([x, text.embed(w, pad)], dim=1), kv2, P,
                            prompt_rows=T + 3, **form)
    assert (h2[:, :T] - h).abs().max().item() <= 1e-5 * ref_h.abs().max().item()
    assert (kv2[..., :P + T, :] - kv).abs().max().item() <= 1e-5 * scale


def test_prompt_rows_follow_the_whole_prefix(model):
    t, w = model.config.text, model.weights
    kv = batched_encode.kv_buffer(model, 1, 4)
    x = torch.zeros(1, model.prefix_len + 3, t.dim)       # one prefix row short
    with pytest.raises(ValueError, match="prefix"):
        prefill_prefix(w, t, x, kv[..., 1:, :], model.prefix_len, prompt_rows=4)


def _frame(seed=0, h=120, w=160):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _engine(model, on: bool, **kw):
    return FastEngine(model, max_batch=2, kv_capacity=model.config.text.max_context,
                      prompt_in_encode=on, encoder="fast", **kw)


@pytest.mark.parametrize("task", [Task("detect", object="person", max_objects=3),
                                  Task("query", question="What is it?", max_tokens=6),
                                  Task("point", object="cup", max_objects=2)],
                         ids=lambda t: t.skill)
def test_run_of_a_frame_takes_the_prompt_from_the_encode(model, task):
    """run(frame, task) with prompt_in_encode: the encode carries the task's prompt
    (PromptPrefill), the run copies it instead of prefilling, and the result is the one
    without it; an encoded image started with another task prefills that task's prompt."""
    frame = _frame()
    on, off = _engine(model, True), _engine(model, False)
    try:
        assert on.prompt_in_encode and not off.prompt_in_encode
        r_off = off.run(frame, task, ignore_eos=True)
        runs = []
        orig = on.start

        def start(enc, t, *a, **k):
            r = orig(enc, t, *a, **k)
            runs.append(r)
            return r
        on.start = start
        r_on = on.run(frame, task, ignore_eos=True)
        assert runs and runs[0].prompt_in_encode
        pp = runs[0].enc.prompt
        prompt = model.tokenizer.prompt(task.skill, task.target)
        assert pp is not None and pp.ids == tuple(prompt)
        t = model.config.text
        assert pp.kv.shape == (t.n_layers, 2, 1, t.n_kv_heads, len(prompt), t.head_dim)
        assert runs[0].enc.kv.shape[4] == model.prefix_len
        assert r_on.output == r_off.output
        assert r_on.tokens == r_off.tokens
        # the same encoded image, another task: its own prompt prefill
        other = Task("caption", caption_length="short", max_tokens=4) if task.skill != "caption" \
            else task
        r2 = on.start(runs[0].enc, other, ignore_eos=True)
        assert not r2.prompt_in_encode
        while r2.step():
            pass
        on.drain()
        assert r2.result().output == off.run(off.encode_image(frame), other,
                                             ignore_eos=True).output
        assert on.batch_encoder.counts["prompts"] >= 1
    finally:
        on.close()
        off.close()


def test_prompt_in_encode_hidden_and_kv_match_the_prompt_prefill(model):
    """The PromptPrefill's hidden state and k/v are the engine's prompt prefill's (fp32)."""
    frame = _frame(1)
    task = Task("detect", object="dog", max_objects=1)
    on = _engine(model, True)
    try:
        prompt = model.tokenizer.prompt(task.skill, task.target)
        enc = on.encode_image(frame, prompt=prompt)
        plain = on.encode_image(frame)
        assert enc.prompt is not None and plain.prompt is None
        assert torch.allclose(enc.kv, plain.kv, rtol=1e-5, atol=1e-5)
        row = 0
        with torch.inference_mode():
            start = on.kv.load_prefix(row, plain)
            last = on.state.prefill_eager(row, start, prompt, 0).clone()
        P, n = model.prefix_len, len(prompt)
        got = on.kv.data[:, :, row:row + 1, :, P:P + n]
        scale = got.abs().max().item()
        assert (enc.prompt.kv - got).abs().max().item() <= 1e-5 * scale
        assert (enc.prompt.hidden - last).abs().max().item() <= 1e-5 * last.abs().max()
        # too long for the prompt rows: no prompt taken
        long = enc.prompt.ids * (PROMPT_ROWS // len(prompt) + 1)
        assert on.encode_image(frame, prompt=list(long)).prompt is None
    finally:
        on.close()


def test_prompt_in_encode_option_rules(model):
    from photon_core.engine import EngineOptions
    with pytest.raises(ValueError, match="prompt_in_encode"):
        EngineOptions(prompt_in_encode="yes")
    e = FastEngine(model, max_batch=1, kv_capacity=model.config.text.max_context)
    try:        # "auto": CUDA only
        assert e.prompt_in_encode is False
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphed_encode_with_prompt_gives_the_same_results():
    """CUDA graphs (the encode with a prompt captured per layout, the fused prefill form):
    run(frame, task) with the default prompt_in_encode ("auto": on) == without (fp32)."""
    m = build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0,
                           device="cuda")
    frame = _frame(2, 240, 320)
    on = FastEngine(m, max_batch=2, megakernel="off")
    off = FastEngine(m, max_batch=2, megakernel="off", prompt_in_encode=False)
    try:
        assert on.prompt_in_encode and not off.prompt_in_encode
        for task in (Task("detect", object="person", max_objects=3),
                     Task("query", question="What is it?", max_tokens=8)):
            for _ in range(2):             # the first run captures the prompt layout
                r_on = on.run(frame, task, ignore_eos=True)
            r_off = off.run(frame, task, ignore_eos=True)
            assert r_on.output == r_off.output and r_on.tokens == r_off.tokens
        assert on.batch_encoder.counts["prompts"] == 4
        assert any(k[0].prompt_rows for k in on.batch_encoder.entries)
        # prepare: the plain single-frame layout now (the prompt one is kept), then nothing
        assert on.prepare_encode(shapes=((240, 320),), batch_sizes=(1,)) == 1
        assert on.prepare_encode(shapes=((240, 320),), batch_sizes=(1,)) == 0
    finally:
        on.close()
        off.close()
