"""photon_core.fast on the CPU: the pipelined fast path gives exactly the reference path's
outputs for every skill and batch size, with mixed skills and mid-flight finishes."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from photon_core.fast import FastEngine
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
from photon_core.task import Task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import cancel_mid_flight  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def encs(model):
    rng = np.random.default_rng(0)
    return [model.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((120, 160), (90, 200))]


TASKS = [Task("detect", object="person", max_objects=6), Task("point", object="cup", max_objects=6),
         Task("query", question="What is it?", max_tokens=12),
         Task("caption", caption_length="short", max_tokens=12),
         Task("detect", object="car", max_objects=2), Task("point", object="dog", max_objects=1),
         Task("query", question="How many?", max_tokens=3),
         Task("query", question="Color?", temperature=0.8, top_p=0.9, seed=5, max_tokens=10)]


def same(a, b):
    return (a.output, a.tokens, a.finish_reason) == (b.output, b.tokens, b.finish_reason)


@pytest.mark.parametrize("pipelined", [True, False])
def test_every_skill_matches_reference(model, encs, pipelined):
    fe = FastEngine(model, max_batch=4, pipelined=pipelined)
    for enc in encs:
        for t in TASKS:
            ref = model.run(enc, t)
            got = fe.run(enc, t)
            assert same(ref, got), (t, ref.output, got.output)
    fe.close()


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_batches_with_mixed_skills_and_zombies_match(model, encs, batch):
    fe = FastEngine(model, max_batch=4)
    fe.decoder.record = True
    zombies = midflight = 0
    for k in range(len(TASKS)):
        group = [(encs[(k + j) % 2], TASKS[(k + j) % len(TASKS)]) for j in range(batch)]
        runs = [fe.start(e, t) for e, t in group]
        finished_at = {}
        calls = 0
        while any(fe.step_batch(runs)):
            calls += 1
            for r in runs:
                if r.finished and id(r) not in finished_at:
                    finished_at[id(r)] = calls
        fe.drain()
        for r in runs:
            finished_at.setdefault(id(r), calls + 1)
        zombies += sum(r.committed > r.steps for r in runs)   # rode along after finishing
        if batch > 1:
            midflight += len(set(finished_at.values())) > 1         # others kept decoding
        for (e, t), r in zip(group, runs):
            assert same(model.run(e, t), r.result()), (batch, t)
        assert all(o is None for o in fe.rows.owner)     # every row released
    assert zombies > 0
    assert batch == 1 or midflight > 0                   # mid-flight finishes happened
    fe.close()


def test_streaming_deltas_match_reference(model, encs):
    fe = FastEngine(model, max_batch=2)
    for t in (Task("query", question="What is it?", max_tokens=20),
              Task("caption", caption_length="normal", max_tokens=20)):
        ref_d, got_d = [], []
        ref = model.run(encs[0], t, stream=ref_d.append)
        got = fe.run(encs[0], t, stream=got_d.append)
        assert ref_d == got_d and same(ref, got)
    fe.close()


def test_ignore_eos_matches_reference(model, encs):
    fe = FastEngine(model, max_batch=2)
    for t in (Task("detect", object="person", max_objects=3),
              Task("query", question="What?", max_tokens=8)):
        r = model.start(encs[1], t, ignore_eos=True)
        while r.step():
            pass
        assert same(r.result(), fe.run(encs[1], t, ignore_eos=True))
    fe.close()


def test_cancel_mid_flight(model, encs):
    fe = FastEngine(model, max_batch=2)
    t = Task("point", object="cup", max_objects=20)
    ref = model.run(encs[0], t).output["points"]
    a = fe.start(encs[0], t, ignore_eos=True)
    b = fe.start(encs[1], Task("query", question="What?", max_tokens=30), ignore_eos=True)
    cancel_mid_flight(fe, a, b)
    res = a.result()
    assert res.finish_reason == "deadline"
    assert res.output["points"] == ref[:len(res.output["points"])]
    b.cancel()
    fe.close()


@pytest.mark.parametrize("graphed_prefill", [True, False])
def test_prefill_paths_match_reference(model, encs, graphed_prefill):
    """Short prompts use graphed_prefill.py (padded to a bucket); prompts longer than the
    largest bucket, or graphed_prefill=False, use the reference's eager prefill."""
    fe = FastEngine(model, max_batch=2, graphed_prefill=graphed_prefill)
    long_q = "What color is the cup on the white table next to the window? " * 10
    assert len(model.tokenizer.encode(long_q)) > 128
    for t in (Task("query", question=long_q, max_tokens=6), Task("point", object="cup", max_objects=3),
              Task("query", question="What is it?", max_tokens=6)):
        assert same(model.run(encs[0], t), fe.run(encs[0], t, ignore_eos=False)), t
    fe.close()


def test_sdpa_attention_variant_matches_reference(model, encs):
    """The GPU's attention form (masked SDPA), run on the CPU."""
    fe = FastEngine(model, max_batch=2, attention="sdpa")
    group = [(encs[0], Task("detect", object="person", max_objects=2)),
             (encs[1], Task("query", question="What is it?", max_tokens=4))]
    for (e, t), r in zip(group, fe.run_batch(group)):
        assert same(model.run(e, t), r)
    fe.close()


def test_graphed_encoder_body_equals_reference_encode(model):
    """graphed_reference_encoder.py's body (eager on the CPU) gives the reference's
    EncodedImage."""
    fe = FastEngine(model, max_batch=1, graphed_encoder=True)
    rng = np.random.default_rng(3)
    for h, w in ((120, 160), (90, 200), (120, 160)):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ref, got = model.encode_image(img), fe.encode_image(img)
        assert torch.equal(ref.kv, got.kv) and ref.tiling == got.tiling
        assert (ref.width, ref.height) == (got.width, got.height)
    assert len(fe.encoder.entries) >= 1          # one per tiling/crop count
    fe.close()


def test_a_task_started_on_an_image_keeps_no_prefix_kv(model):
    """start(image): the run copies the encode's k/v into its row (on the GPU from the
    encode graph's own output, graphed_batch_encoder's borrow) and keeps only the prefix's
    length - no handle that a later encode could change under it. Two images started one
    after the other (the second encode queued before either run decodes) give the results
    of tasks on their own encodings."""
    fe = FastEngine(model, max_batch=2, encoder="fast")   # (the batched encoder's path)
    assert fe._batch_encodes("overlap")
    rng = np.random.default_rng(5)
    imgs = [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(2)]
    t = Task("detect", object="person", max_objects=3)
    encs_ = [fe.encode_image(i) for i in imgs]
    refs = [fe.run(e, t) for e in encs_]
    runs = [fe.start(i, t) for i in imgs]
    for r, e in zip(runs, encs_):
        assert r.enc.kv is None and r.enc.length == e.length > 0
    while any(fe.step_batch(runs)):
        pass
    fe.drain()
    for r, ref in zip(runs, refs):
        assert same(r.result(), ref)
    on_enc = fe.start(encs_[0], t)                # an encoded image is the caller's: kept
    assert on_enc.enc is encs_[0]
    on_enc.cancel()
    fe.drain()
    fe.close()
