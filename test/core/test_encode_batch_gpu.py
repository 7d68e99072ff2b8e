"""Batched / faster image encode on a GPU (skipped without CUDA): the graphed batch encoder
(encoder "reference" and "fast") against the reference encode_image per frame, the GELU
epilogue against the tanh GELU, tasks on batched encodings against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _frames():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for h, w in ((120, 160), (90, 200), (120, 160), (200, 300))]


def test_linear_gelu_epilogue_is_the_tanh_gelu():
    from photon_core.ops.linear_gelu import linear_gelu

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 256, device="cuda", generator=g)
    w = torch.randn(384, 256, device="cuda", generator=g) / 8
    b = torch.randn(384, device="cuda", generator=g)
    y, lin = linear_gelu(x, w, b), F.linear(x, w, b)
    tanh, erf = F.gelu(lin, approximate="tanh"), F.gelu(lin)
    d_tanh, d_erf = (y - tanh).abs().max().item(), (y - erf).abs().max().item()
    assert d_tanh <= 1e-4 * lin.abs().max().item() and d_tanh < d_erf / 4, (d_tanh, d_erf)
    yb = linear_gelu(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert (yb.float() - tanh).abs().max().item() <= 3e-2 * tanh.abs().max().item()


@pytest.mark.parametrize("dtype,encoder", [("fp32", "reference"), ("fp32", "fast"),
                                           ("bf16", "reference"), ("bf16", "fast")])
def test_graphed_encode_batch_matches_reference(dtype, encoder):
    from photon_core.encode_request import EncodeRequest
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype=dtype, seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, max_batch=4, encoder=encoder)
    frames = _frames()
    reqs = [frames[0], EncodeRequest(frames[1], "global"), frames[2], frames[3]]
    refs = [m.encode_image(r) for r in reqs]
    tol = 1e-4 if dtype == "fp32" else 5e-2
    for _ in range(3):                       # frame by frame, then captured, then replayed
        got = fe.encode_batch(reqs)
        for r, g in zip(refs, got):
            assert (r.tiling, r.crops, r.n_crops) == (g.tiling, g.crops, g.n_crops)
            err = (r.kv.float() - g.kv.float()).abs().max().item()
            assert err <= tol * max(r.kv.float().abs().max().item(), 1.0), err
    assert fe.batch_encoder.n_batch_graphs() == 1
    single = fe.encode_image(frames[0])
    assert (single.kv.float() - refs[0].kv.float()).abs().max().item() <= \
        tol * max(refs[0].kv.float().abs().max().item(), 1.0)
    assert fe.prepare_encode(shapes=((120, 160),), batch_sizes=(2,)) == 1
    before = fe.batch_encoder.counts["batched"]
    pair = fe.encode_batch([frames[0], frames[2]])             # prepared: batched at once
    assert fe.batch_encoder.counts["batched"] == before + 1
    assert (pair[1].kv.float() - refs[2].kv.float()).abs().max().item() <= \
        tol * max(refs[2].kv.float().abs().max().item(), 1.0)
    if dtype == "fp32":
        tasks = [Task("detect", object="person", max_objects=4), Task("point", object="cup"),
                 Task("query", question="What is it?", max_tokens=8),
                 Task("caption", caption_length="short", max_tokens=8)]
        for r, t, res in zip(refs, tasks, fe.run_batch(list(zip(got, tasks)))):
            ref = m.run(r, t)
            assert (res.output, res.tokens) == (ref.output, ref.tokens)
    fe.close()


def test_tasks_started_on_images_borrow_the_encode_graph_output():
    """FastEngine.start(image) copies the k/v into the run's row straight from the encode
    graph's output (graphed_batch_encoder's borrow: no copy of its own): two frames of one
    layout started back to back - the second replay overwrites that output before either
    run decodes - give the outputs of tasks on owned encodings, in the graph replay."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype="fp32", seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, max_batch=2)
    frames = [f for f in _frames() if f.shape[:2] == (120, 160)]
    t = Task("query", question="What is it?", max_tokens=8)
    encs = [fe.encode_image(f) for f in frames]           # captures the layout's graph
    refs = [fe.run(e, t) for e in encs]
    assert refs[0].tokens != refs[1].tokens     # (a run on the other's k/v would show)
    before = fe.batch_encoder.counts["single"]
    runs = [fe.start(f, t) for f in frames]
    assert fe.batch_encoder.counts["single"] == before + 2     # both through the graph
    assert all(r.enc.kv is None for r in runs)
    while any(fe.step_batch(runs)):
        pass
    fe.drain()
    for r, ref in zip(runs, refs):
        got = r.result()
        assert (got.output, got.tokens) == (ref.output, ref.tokens)
    fe.close()
