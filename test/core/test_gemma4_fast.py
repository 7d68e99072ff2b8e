"""Gemma 4 on the fast path (photon_core.fast.FastEngine over the family's FastFamily view,
models/gemma4/fast_family.py: the step program with per-layer attention over ring and
full-length state of their own head sizes, per-layer embeddings, the scaled-token feedback):
on the tiny random fp32 checkpoint the fast path gives the reference engine's greedy tokens,
text and finish reasons for query and caption at batch 1, 2 and 4 (the eager backend on the
CPU; the fused backend's Triton kernels under TRITON_INTERPRET=1). The tiny model's sliding
window is 8 and every context is longer (image prefixes of 70+ tokens, prompts of 10-150
tokens), layers 4 and 5 are KV-shared; a run cancelled mid-flight leaves a zombie step whose
row is released at its commit; detect / point are refused with the family's message."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from photon_core.fast import FastEngine
from photon_core.models import gemma4
from photon_core.task import Task, TaskError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import cancel_mid_flight, results_and_text  # noqa: E402
from engine_runs import fused_ok as _fused_ok  # noqa: E402
from engine_runs import fused_pattern_bits, pdl_changes_no_bits  # noqa: E402
from engine_runs import same_run as _same  # noqa: E402

KV = 256      # state-cache positions per row (the CPU default, max_context 4096, is slow)
TASKS = [Task("query", question="What color is the cup?", max_tokens=10),
         Task("caption", caption_length="short", max_tokens=8),
         Task("query", question="Describe everything you can see on the table in detail.",
              max_tokens=14),
         Task("caption", caption_length="long", max_tokens=5)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = gemma4.make_test_model(tmp_path_factory.mktemp("g4f"), seed=3)
    return gemma4.load_model(str(ckpt), max_soft_tokens=70)


@pytest.fixture(scope="module")
def encs(model):
    rng = np.random.default_rng(11)
    return [model.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((36, 30), (48, 64))]


_REFS: dict = {}


def _reference(model, enc, task, ignore_eos=False):
    key = (id(model), id(enc), repr(task), ignore_eos)
    if key not in _REFS:
        r = model.start(enc, task, ignore_eos=ignore_eos)
        while r.step():
            pass
        _REFS[key] = (r.result(), r.streamer.text)
    return _REFS[key]


def _fast(fe, pairs, ignore_eos=False):
    out = results_and_text(fe, pairs, ignore_eos)
    assert all(o is None for o in fe.rows.owner)          # every row released
    return out


def test_fast_family_view(model, encs):
    """The program's state: rings of `window` slots for the sliding layers that compute k/v,
    full-length wider heads for the global one, nothing for the KV-shared layers; the
    prefix holds every such layer's k/v of the image prefix (longer than the window)."""
    fam = model.fast_family()
    assert fam is model.fast_family()
    cfg = model.config.text
    W = cfg.sliding_window
    prog = fam.spec.program
    assert [(s.kind, s.layer, s.shape) for s in prog.state] == [
        ("ring", 0, (2, W, 16)), ("ring", 1, (2, W, 16)), ("kv", 2, (2, 32)),
        ("ring", 3, (2, W, 16))]                          # layers 4, 5: KV-shared
    atts = [op.param("attn") for op in prog.ops if op.kind == "window_attention"]
    assert [a.source for a in atts] == [0, 1, 2, 3, 3, 2]
    p = fam.prefix(encs[0])
    assert fam.prefix(encs[0]) is p and p.length == encs[0].length > W
    assert [t.shape for t in p.kv] == [(2, 1, 2, p.length, 16)] * 2 + [
        (2, 1, 2, p.length, 32), (2, 1, 2, p.length, 16)]
    for t in TASKS:
        assert fam.count_prompt_tokens(t) == len(fam.prompt(t, encs[0]))
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    assert fe.kv.data is None and fe.kv.k[0].shape == (2, 2, W, 16)
    assert fe.kv.k[2].shape == (2, 2, KV, 32) and 4 not in fe.kv.k
    # a ring row keeps the prefix's last W positions, slot p % W
    fe.kv.load_prefix(1, p)
    n = p.length
    for q in range(n - W, n):
        torch.testing.assert_close(fe.kv.k[3][1, :, q % W], encs[0].cache.k[3][:, q],
                                   atol=0, rtol=0)
    torch.testing.assert_close(fe.kv.v[2][1, :, :n], encs[0].cache.v[2][:, :n], atol=0, rtol=0)
    with pytest.raises(ValueError, match="different model"):
        fe.start(encs[0].__class__(**{**encs[0].__dict__, "model_id": "other"}), TASKS[0])
    fe.close()


@pytest.mark.parametrize("fused", ["off", "on"])
def test_fast_path_matches_reference(model, encs, fused):
    _fused_ok(fused)
    fe = FastEngine(model, max_batch=4, kv_capacity=KV, fused=fused)
    assert (fe.state.fused is not None) == (fused == "on")
    if fused == "on":     # what ran outside the kernels: only the per-layer projection (K 8)
        f = fe.state.fused
        assert {w[0].rsplit(".", 1)[-1] for w in f.torch_linears} == {"per_layer_projection"}
        assert f.fused_norm_adds == 3 * model.config.text.n_layers
    # batch 1 (fused: the caption from an idle engine; the query at bucket 1 is the batch of
    # 4's tail below)
    tasks = TASKS if fused == "off" else TASKS[1:2]
    for i, enc in enumerate(encs if fused == "off" else encs[:1]):          # batch 1
        for t in tasks:
            got = _fast(fe, [(enc, t)])[0]
            assert _same(got, _reference(model, enc, t)), (i, t)
    # two frames, mixed skills and lengths in one batch (fused: the batch of 4 covers the
    # batch of 2's cases; it was 1/3 of CI's longest test)
    for batch in ((2, 4) if fused == "off" else (4,)):
        pairs = [(encs[j % 2], TASKS[j % len(TASKS)]) for j in range(batch)]
        if fused == "on":    # the longest (14 steps) in row 0: it ends alone, at bucket 1
            pairs[0], pairs[2] = pairs[2], pairs[0]
            assert max(t.max_tokens for _, t in pairs) == pairs[0][1].max_tokens > max(
                t.max_tokens for _, t in pairs[1:])
        for (e, t), got in zip(pairs, _fast(fe, pairs)):
            assert _same(got, _reference(model, e, t)), (batch, t)
    fe.close()


def test_fused_patterns_change_no_bits(model, monkeypatch):
    """The fused backend's lowering patterns: a sandwich norm's kernel also writes the RMSNorm
    after it (pre-feedforward; the next layer's input norm), the MLP's [gate, up] GEMV and
    the per-layer input gate's GEMV write the gated activation: the same bits as op by op,
    2 L - 1 + 2 L fewer launches (PLE gate reads the fp32 x: no cast)."""
    _fused_ok("on")
    (x1, b1, (chained, gated, n1)), (x0, b0, (c0, g0, n0)) = fused_pattern_bits(
        model, KV, monkeypatch)
    L = model.config.text.n_layers
    assert (chained, gated, c0, g0) == (2 * L - 1, 2 * L, 0, 0)
    assert n0 - n1 == chained + gated
    assert torch.equal(x1, x0)
    # h: the last layer's post-feedforward output feeds no chained norm; m / pm: the gated
    # outputs (gate / up / pg are not written with the patterns on)
    for seg in ("h", "o") + tuple(s for s, _ in model.fast_family().spec.program.buffers[1][1]
                                  if s.startswith(("m.", "pm"))):
        buf, off, w = model.fast_family().spec.program.segment(seg)
        assert torch.equal(b1[buf][:, off:off + w], b0[buf][:, off:off + w]), seg


def test_fused_pass_with_pdl_gives_the_same_bits(model, monkeypatch):
    """EngineOptions.pdl (the GEMVs, sandwich norms, norm + rotary, k/v slot write and
    window attention kernels with their PDL arguments) changes no bit of the pass."""
    from photon_core.fast.fused_backend import PDL_AUTO_ROWS, auto_pdl_rows
    _fused_ok("on")
    pdl_changes_no_bits(model, KV, monkeypatch)
    assert auto_pdl_rows(model.fast_family().spec.program) == PDL_AUTO_ROWS   # pdl "auto"


def test_encode_runs_only_the_layers_that_store_kv(model, monkeypatch):
    """encode_body's text.prefix_kv (layers 0 .. first_shared - 1; the KV-shared layers
    store no k/v) gives forward_ids' cache over the whole decoder, bit for bit."""
    from photon_core.models.gemma4 import text
    from photon_core.models.gemma4.kv_cache import KVCache
    t = model.config.text
    assert 0 < t.first_shared < t.n_layers
    frame = np.random.default_rng(9).integers(0, 256, (36, 30, 3), dtype=np.uint8)
    ran = []
    layer = text.layer
    monkeypatch.setattr(text, "layer", lambda w, cfg, i, *a, **k: (ran.append(i),
                                                                    layer(w, cfg, i, *a,
                                                                          **k))[1])
    enc = model.encode_image(frame)
    assert ran == list(range(t.first_shared))
    _, patches, positions, grid = model.image_inputs(frame)
    emb = model.image_embeddings(patches, positions, grid)
    ids = model.prefix_ids(emb.shape[0])
    full = KVCache(t, len(ids), model.device, model.dtype)
    ran.clear()
    with torch.inference_mode():
        model.forward_ids(torch.tensor(ids), 0, full, emb)
    assert ran == list(range(t.n_layers))
    for a, b in zip(enc.cache.k + enc.cache.v, full.k + full.v):
        assert (a is None and b is None) or torch.equal(a, b)


def test_prefix_attention_by_sdpa(model, monkeypatch):
    """The fast encode's prefix attention (text.FAST.attend = window_attention_sdpa: SDPA
    with the window / image-block mask) in encode_body(fast=True) against the reference
    encode_body's fp32 scores (fp32, CPU; the other FAST ops kept torch's): the cache
    within fp32 rounding, and the mask matters (a causal-only SDPA differs)."""
    import torch.nn.functional as F
    from photon_core.models.gemma4 import text
    from photon_core.ops.sliding_window_attention import window_attention_sdpa
    frame = np.random.default_rng(4).integers(0, 256, (36, 30, 3), dtype=np.uint8)
    inp = model.encode_inputs(frame)

    def caches(attend=None):
        if attend is not None:
            monkeypatch.setattr(text, "fast_ops_on", lambda t: text.REFERENCE._replace(
                attend=attend))
        c = model.encode_body(inp, fast=attend is not None)
        return [a for a in c.k + c.v if a is not None]

    want = caches()
    for a, b in zip(caches(window_attention_sdpa), want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)   # (the fast tower's too)

    def causal_only(q, k, v, p, window, scale, blocks):
        rep = q.shape[0] // k.shape[0]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                              v.repeat_interleave(rep, 0), is_causal=True,
                                              scale=scale)
    assert max((a - b).abs().max() for a, b in zip(caches(causal_only), want)) > 1e-2


def test_fast_vision_tower_and_encode_body(model):
    """vision_fast.FastTower (the fast encode's tower: concatenated q|k|v and gate|up GEMMs,
    SDPA attention) against vision.tower in fp32, with and without clipped linears; the
    engine's fast encoder (GraphedReferenceEncoder over encode_body_fast, eager on the CPU)
    gives an encoded image whose k/v and tokens match the reference encode's."""
    from photon_core.fast.graphed_reference_encoder import GraphedReferenceEncoder
    from photon_core.models.gemma4 import vision
    from photon_core.models.gemma4.vision_fast import FastTower
    from dataclasses import replace
    rng = np.random.default_rng(5)
    frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    _, patches, positions, grid = model.image_inputs(frame)
    w, cfg = model.weights, model.config.vision
    want = vision.tower(w, cfg, patches, positions, grid)
    got = FastTower(w, cfg)(patches, positions, grid)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if os.environ.get("TRITON_INTERPRET") == "1":   # q / k's norm + axial rotary kernel
        # (one interpreted program per patch: the frame at a 12-token budget, 9 x 12 patches,
        # not 567 - 3 s, not 15)
        few = vision.preprocess(frame, cfg, 12)
        assert few[2][0] != few[2][1] and len(few[0]) < 150, few[2]
        got = FastTower(w, cfg, kernels=True)(*few)
        torch.testing.assert_close(got, vision.tower(w, cfg, *few), atol=2e-5, rtol=2e-5)
    if not cfg.clipped_linears:          # the per-projection path of clipped checkpoints
        tower = FastTower(w, replace(cfg, clipped_linears=True))
        assert not tower.qkv
        clip = dict(w)
        for j in range(cfg.n_layers):
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                for end, v in ((".input_min", -1e4), (".input_max", 1e4),
                               (".output_min", -1e4), (".output_max", 1e4)):
                    clip[vision.vision_layer(j, n + end)] = torch.tensor(v)
        tower.w = clip
        torch.testing.assert_close(tower(patches, positions, grid), want, atol=2e-5,
                                   rtol=2e-5)
    enc = GraphedReferenceEncoder(model, False, body=model.encode_body_fast).encode(frame)
    ref = model.encode_image(frame)
    assert enc.length == ref.length
    for a, b in zip(enc.cache.k + enc.cache.v, ref.cache.k + ref.cache.v):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    t = TASKS[0]
    fe = FastEngine(model, max_batch=1, kv_capacity=KV)
    got, want = fe.run(enc, t), _reference(model, ref, t)[0]
    assert (got.output, got.tokens, got.finish_reason) == (want.output, want.tokens,
                                                           want.finish_reason)
    fe.close()


def test_long_prompt_sampling_and_streaming(model, encs):
    """A question of more than 128 prompt tokens takes the generic eager prefill (through
    the family's feedback embedding); a seeded sampled query draws the reference's tokens;
    streamed deltas concatenate to the answer."""
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    q = "What color is the cup next to the red car on the busy street? " * 10
    t = Task("query", question=q, max_tokens=6)
    assert fe.count_prompt_tokens(t) > 128
    assert _same(_fast(fe, [(encs[0], t)])[0], _reference(model, encs[0], t))
    t = Task("query", question="Color?", temperature=0.8, top_p=0.9, seed=5, max_tokens=8)
    assert _same(_fast(fe, [(encs[1], t)])[0], _reference(model, encs[1], t))
    deltas = []
    got = fe.run(encs[0], TASKS[0], stream=deltas.append)
    assert "".join(deltas) == got.output["answer"] == _reference(model, encs[0],
                                                                 TASKS[0])[0].output["answer"]
    fe.close()


def test_cancel_mid_flight_leaves_a_zombie(model, encs):
    """A run cancelled while its next step is in flight: that step commits as a zombie (its
    row released then); the tokens it had are the reference's first ones; the run beside
    it is unaffected."""
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    ta = Task("query", question="What is on the table?", max_tokens=20)
    tb = Task("caption", caption_length="normal", max_tokens=12)
    a, b = fe.start(encs[0], ta, ignore_eos=True), fe.start(encs[1], tb, ignore_eos=True)
    cancel_mid_flight(fe, a, b)
    assert a.committed > a.steps
    res = a.result()
    ref = _reference(model, encs[0], ta, ignore_eos=True)[0]
    assert res.finish_reason == "deadline" and 0 < res.tokens < ref.tokens
    ids = model.prompter.tok.encode(ref.output["answer"], add_special_tokens=False).ids
    assert res.output["answer"] == model.prompter.decode(ids[:res.tokens]) or \
        ref.output["answer"].startswith(res.output["answer"])
    while b.step():
        pass
    fe.drain()
    assert _same((b.result(), b.text_so_far), _reference(model, encs[1], tb, ignore_eos=True))
    fe.close()


def test_reused_row_after_a_longer_task(model, encs):
    """Rows reused by a shorter context than their previous task (full rings, k/v far
    beyond): the stale slots are never read."""
    fe = FastEngine(model, max_batch=1, kv_capacity=KV)
    long_t = Task("query", question="Describe everything. " * 12, max_tokens=30)
    _fast(fe, [(encs[1], long_t)], ignore_eos=True)
    assert _same(_fast(fe, [(encs[0], TASKS[1])])[0], _reference(model, encs[0], TASKS[1]))
    fe.close()


@pytest.mark.parametrize("skill", ["detect", "point"])
def test_detect_and_point_refused_with_the_family_message(model, encs, skill):
    fe = FastEngine(model, max_batch=1, kv_capacity=KV)
    task = Task(skill, object="person")
    with pytest.raises(TaskError, match=f"Gemma 4 \\(E2B/E4B\\) does not support {skill}"):
        fe.start(encs[0], task)
    with pytest.raises(TaskError, match="does not support"):     # before any encode work
        fe.start(np.zeros((8, 8, 3), np.uint8), task)
    assert all(o is None for o in fe.rows.owner)
    assert fe.capabilities.skill_refusal(skill) == model.capabilities.skill_refusal(skill)
    fe.close()


def test_keys_equal_values_variant(tmp_path):
    """attention_k_eq_v (global layers take v from the raw k, no v_proj) on the fast path."""
    m = gemma4.load_model(str(gemma4.make_test_model(tmp_path, seed=5,
                                                     text={"attention_k_eq_v": True})),
                          max_soft_tokens=70)
    enc = m.encode_image(np.random.default_rng(2).integers(0, 256, (40, 40, 3), np.uint8))
    fe = FastEngine(m, max_batch=2, kv_capacity=KV)
    pairs = [(enc, TASKS[0]), (enc, TASKS[1])]
    for (e, t), got in zip(pairs, _fast(fe, pairs)):
        assert _same(got, _reference(m, e, t))
    fe.close()


def test_registry_and_load_engine_serve_it_fast(model):
    """FAST_PATH: the registry says so, and load_engine(engine="fast") builds FastEngine
    (on CUDA, engine "auto" does: the node's default)."""
    from photon_core import EngineOptions, load_engine
    from photon_core.models import families, has_fast_path

    assert has_fast_path(families()["gemma4"])
    fe = load_engine(model.model_id, engine="fast",
                     options=EngineOptions(max_batch=1, kv_capacity=KV), max_soft_tokens=70)
    assert isinstance(fe, FastEngine) and fe.max_runs == 1
    assert fe.capabilities.family == "gemma4" and fe.capabilities.skills == {"query",
                                                                             "caption"}
    fe.close()
