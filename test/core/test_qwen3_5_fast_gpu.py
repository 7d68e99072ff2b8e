"""Qwen 3.5 on the fast path on a GPU (skipped without CUDA): CUDA graphs (decode pieces,
prompt prefill) over the hybrid step program give the reference engine's greedy results in
fp32 (eager backend and, fused="on", the fp32 GEMV kernels), and a bf16 engine (fused
backend by default) serves every skill at batch 1 and 4 with valid results."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import fast_encode_follows_reference, graphed_encodes  # noqa: E402


def _tasks():
    from photon_core.task import Task
    return [Task("query", question="What color is the cup?", max_tokens=16),
            Task("caption", caption_length="short", max_tokens=12),
            Task("detect", object="person", max_objects=1),
            Task("point", object="cup", max_objects=1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from photon_core.models import qwen3_5
    return qwen3_5.make_test_model(tmp_path_factory.mktemp("q35g"), seed=5)


@pytest.fixture(scope="module")
def frame():
    return np.random.default_rng(3).integers(0, 256, (96, 128, 3), dtype=np.uint8)


@pytest.mark.parametrize("fused,pdl", [("off", False), ("on", False), ("on", True)])
def test_graphs_match_reference_fp32(ckpt, frame, fused, pdl):
    """(pdl: every PDL-capable kernel of the step launched with programmatic dependent
    launch, ops/pdl.py - on a Hopper GPU with its griddepcontrol waits)"""
    from photon_core.fast import FastEngine
    from photon_core.models import qwen3_5

    m = qwen3_5.load_model(str(ckpt), device="cuda", dtype="fp32")
    fe = FastEngine(m, max_batch=4, kv_capacity=512, fused=fused, pdl=pdl)
    assert fe.use_graphs and len(fe.runner.graphs) > 0
    # the prompt prefill's graphs (a bucket that could not be captured runs eagerly)
    assert not fe.prefill.capture_errors, fe.prefill.capture_errors
    enc = fe.encode_image(frame)
    tasks = _tasks()
    for r, t in zip(fe.run_batch([(enc, t) for t in tasks]), tasks):
        ref = m.run(enc, t)
        assert (r.output, r.tokens, r.finish_reason) == (ref.output, ref.tokens,
                                                         ref.finish_reason), t
    for t in tasks:
        r, ref = fe.run(enc, t), m.run(enc, t)
        assert (r.output, r.tokens, r.finish_reason) == (ref.output, ref.tokens,
                                                         ref.finish_reason), t
    fe.close()


def test_bf16_serves_every_skill(ckpt, frame):
    from photon_core import EngineOptions, load_engine
    from photon_core.fast import FastEngine

    fe = load_engine(str(ckpt), device="cuda", dtype="bf16",
                     options=EngineOptions(max_batch=4, kv_capacity=512))
    assert isinstance(fe, FastEngine) and fe.state.fused is not None
    enc = fe.encode_image(frame)
    tasks = _tasks()
    for res in fe.run_batch([(enc, t) for t in tasks]) + [fe.run(enc, t) for t in tasks]:
        assert res.finish_reason in ("stop", "length") and res.tokens >= 0
    q = fe.run(enc, tasks[0], ignore_eos=True)
    assert q.tokens == 16 and q.finish_reason == "length"
    fe.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graphed_encode_is_the_reference_encode(ckpt, dtype):
    """FastEngine.encode_image replays the reference encode as one CUDA graph per layout
    (fast/graphed_reference_encoder.py): every state tensor of the encoded image is the
    reference encode_image's, bit for bit - for the frame that captured the graph, a later
    frame of its size (replay), and a frame of another size (a second graph); each encoded
    image owns its state."""
    from photon_core.fast import FastEngine
    from photon_core.models import qwen3_5

    m = qwen3_5.load_model(str(ckpt), device="cuda", dtype=dtype)
    fe = FastEngine(m, max_batch=1, kv_capacity=512, encoder="reference")
    pairs = graphed_encodes(fe, m, ((96, 128, 3), (96, 128, 3), (64, 64, 3)))
    for enc, ref in pairs:
        s, r = enc.state, ref.state
        assert (s.length, s.rope_pos, s.tokens, enc.grid) == (r.length, r.rope_pos, r.tokens,
                                                              ref.grid)
        for name in ("k", "v", "conv", "recurrent"):
            a, b = getattr(s, name), getattr(r, name)
            assert a.keys() == b.keys()
            for i in a:
                assert torch.equal(a[i][..., :s.length, :] if name in "kv" else a[i],
                                   b[i][..., :r.length, :] if name in "kv" else b[i]), (name, i)
    (a, _), (b, _) = pairs[:2]
    layer = next(iter(a.state.k))
    assert a.state.k[layer].data_ptr() != b.state.k[layer].data_ptr()
    fe.close()


@pytest.mark.parametrize("scan,conv,prep", [(False, False, False), (True, False, False),
                                            (True, True, True)],
                         ids=["torch-loop", "scan-kernel", "default"])
def test_fast_encode_follows_the_reference_encode(ckpt, monkeypatch, scan, conv, prep):
    """FastEngine's default encoder on CUDA ("fast": the image prefix's norms, residual adds
    and MLP gates as Triton kernels and the delta rule's fast form, decoder.forward(
    fused_norms=True)) against the reference encode_image (engine_runs.
    fast_encode_follows_reference: fp32 within 2e-4, bf16 at most 3x the bf16 reference
    encode's error against fp32); scan: gated_delta_rule.FAST_SCAN (the loop over chunks as
    the Triton scan kernel; torch-loop: the form without it); conv: decoder.FAST_CONV (the
    causal conv as one Triton launch); prep: gated_delta_rule.FAST_PREP (what feeds the
    scan, one launch); "default": all three, the defaults since session 17."""
    from photon_core.models import qwen3_5
    from photon_core.models.qwen3_5 import decoder
    from photon_core.ops import gated_delta_rule
    monkeypatch.setattr(gated_delta_rule, "FAST_SCAN", scan)
    monkeypatch.setattr(decoder, "FAST_CONV", conv)
    monkeypatch.setattr(gated_delta_rule, "FAST_PREP", prep)

    def state(enc):
        s = enc.state
        return ([s.k[i][..., :s.length, :] for i in s.k] +
                [s.v[i][..., :s.length, :] for i in s.v] + list(s.conv.values()) +
                list(s.recurrent.values()))

    fast_encode_follows_reference(
        lambda dtype: qwen3_5.load_model(str(ckpt), device="cuda", dtype=dtype),
        ((96, 128, 3), (96, 128, 3), (64, 64, 3)), state)
