"""photon_core.fast on a GPU (skipped without CUDA): CUDA-graph steps give the reference
path's outputs (fp32), and GPU idle per step is measured."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import graphed_encodes  # noqa: E402


def test_graphs_match_reference_and_measure_idle():
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype="fp32", seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, max_batch=4)
    # pieces (lm, lm_sample, coord, size, forward; + forward#0 / #1, the forward with the
    # staging copy of each ping-pong slot, when cuda_graph_runner.STAGED_FORWARD; + each of
    # the 4 heads merged with each of those, when MERGED_STEP too) x buckets
    from photon_core.fast import cuda_graph_runner as cgr
    staged = 2 if cgr.STAGED_FORWARD else 0
    assert len(fe.runner.graphs) == (5 + staged + 4 * staged * cgr.MERGED_STEP) * 3
    enc = m.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    tasks = [Task("detect", object="person", max_objects=4), Task("point", object="cup", max_objects=4),
             Task("query", question="What is it?", max_tokens=16),
             Task("caption", caption_length="short", max_tokens=16)]
    for r, t in zip(fe.run_batch([(enc, t) for t in tasks]), tasks):
        ref = m.run(enc, t)
        assert (r.output, r.tokens, r.finish_reason) == (ref.output, ref.tokens, ref.finish_reason)
    fe.run(enc, Task("query", question="What?", max_tokens=20), ignore_eos=True)
    idle = fe.metrics()["gpu_idle_per_step"]
    assert idle["n"] > 10 and idle["median_ms"] < 1.0
    fe.close()


@pytest.mark.parametrize("parts", [False, True])
def test_a_garbage_collection_inside_a_capture_frees_no_graph(parts):
    """A dead CUDA graph in a reference cycle (a closed engine's: engines hold cycles) is
    not freed by a collection that the capture's own allocations would trigger: its
    cudaGraphExecDestroy would invalidate the capture (cuda_graph_runner.PAUSE_GC; session
    35's flaky GPU test failures). capture_graph and capture_graph_parts alike."""
    import gc

    from photon_core.fast.cuda_graph_runner import capture_graph, capture_graph_parts

    class Holder:
        pass

    x = torch.zeros(8, device="cuda")
    gc.collect()
    h = Holder()
    h.self = h                          # a cycle: only the collector frees it
    h.graph = capture_graph(lambda: x.add_(1))[0]
    keep = [h]
    del h
    old = gc.get_threshold()

    def fn():
        keep.clear()                    # the cycle (and its graph) is garbage now
        gc.set_threshold(1, 1, 1)       # the next allocations trigger collections
        junk = [[i] for i in range(64)]
        gc.set_threshold(*old)
        return x.mul_(2) if junk else None

    try:
        if parts:
            g = capture_graph_parts(lambda cut: (fn(), cut(), x.add_(3))[0])[0]
        else:
            g = capture_graph(fn)[0]
    finally:
        gc.set_threshold(*old)
    gc.collect()                        # (outside a capture: the dead graph goes now)
    x.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [3.0 if parts else 0.0] * 8
    x.fill_(1)
    g.replay()
    assert x.tolist() == [5.0 if parts else 2.0] * 8


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prefill_agrees_across_engines_and_with_eager(dtype):
    """The graphed prompt prefill gives the same last hidden state in two engines built in one
    process (a lifecycle re-activate builds a second engine), and agrees with the eager
    (reference) prefill."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype=dtype, seed=0)
    enc = m.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    task = Task("detect", object="person", max_objects=2)
    ref = m.start(enc, task).hidden[0, 0].float()
    hidden = []
    for graphed in (True, True, False):
        fe = FastEngine(m, max_batch=2, graphed_prefill=graphed)
        run = fe.start(enc, task)
        torch.cuda.synchronize()
        hidden.append(fe.state.hidden[run.row].float().clone())
        run.cancel()
        fe.close()
    tol = 1e-4 if dtype == "fp32" else 5e-2
    scale = ref.abs().max().item()
    for h in hidden:
        assert (h - ref).abs().max().item() <= tol * max(scale, 1.0), (h - ref).abs().max().item()
    assert torch.equal(hidden[0], hidden[1]), "two engines disagree after the graphed prefill"


def test_seeded_sampling_repeats_on_the_gpu():
    """A sampled query with a seed gives the same tokens on every run on the GPU path, also
    next to another run in the batch; other seeds give other samples."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype="fp32", seed=0)
    fe = FastEngine(m, max_batch=4)
    enc = m.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))

    def q(seed):
        return Task("query", question="What is it?", max_tokens=24, temperature=1.0,
                    seed=seed)
    first = fe.run(enc, q(7), ignore_eos=True).output
    assert fe.run(enc, q(7), ignore_eos=True).output == first
    batch = fe.run_batch([(enc, q(7)), (enc, q(8))], ignore_eos=True)
    assert batch[0].output == first
    others = {fe.run(enc, q(s), ignore_eos=True).output["answer"] for s in range(20, 26)}
    assert len(others) > 1
    fe.close()


@pytest.mark.parametrize("act,n,k", [("silu", 3584, 1024), ("gelu_tanh", 6144, 1536),
                                     ("silu", 6144, 2048)])
@pytest.mark.parametrize("b", [1, 8])
def test_gated_epilogue_is_the_two_launches_bit_for_bit(act, n, k, b):
    """ops/gemv EPI_GATED on the GPU in bf16 at Qwen 3.5 / Gemma 4 MLP shapes: the same bits
    as the GEMV into [gate | up] followed by the gated activation kernel (the fused backend's
    lowering before the epilogue), with gemv.pick's config for the shape."""
    from photon_core.ops import gemv as G
    from photon_core.ops.gated_activation import gated_activation_triton
    g = torch.Generator(device="cuda").manual_seed(n + b)
    x = torch.randn(b, k, device="cuda", generator=g).bfloat16()
    wg, wu = ((torch.randn(n, k, device="cuda", generator=g) / 30).bfloat16() for _ in range(2))
    two = torch.empty(b, 2 * n, device="cuda", dtype=torch.bfloat16)
    G.gemv(x, torch.cat([wg, wu]), None, two)
    want = gated_activation_triton(two[:, :n], two[:, n:], act)
    y = torch.empty(b, n, device="cuda", dtype=torch.bfloat16)
    G.gemv(x, G.interleave_gated(wg, wu).contiguous(), None, y, G.EPI_GATED, act=act)
    assert G.pick(b, 2 * n, k, G.EPI_GATED) == G.pick(b, 2 * n, k, G.EPI_STORE)
    assert torch.equal(y, want)


@pytest.mark.parametrize("n,k,epi", [(14336, 2048, 1), (2048, 10240, 2), (51200, 2048, 0),
                                     (6144, 2048, 3)])
@pytest.mark.parametrize("b", [1, 2, 8])
def test_gemv_weights_by_tma_are_the_pointer_loads_bits(n, k, epi, b):
    """ops/gemv's weight tiles by bulk tensor copies (TMA "on") on the GPU in bf16 at the
    decode shapes, with gemv.pick's tiles (those the copy engine takes; deterministic, so no
    split-K): the same bits as the pointer loads."""
    from photon_core.ops import gemv as G
    g = torch.Generator(device="cuda").manual_seed(n + b)
    x = torch.randn(b, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / 30).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g)
    bias = bias if epi == G.EPI_RESIDUAL else bias.bfloat16()
    cfg = G.pick(b, n, k, epi, deterministic=True)
    if cfg.block_k > 256:
        cfg = G.GemvConfig(cfg.block_n, 256, 1, cfg.num_warps, cfg.num_stages, cfg.dot)
    ys = []
    keep = G.TMA
    try:
        for tma in ("on", "off"):
            G.TMA = tma
            assert (G.tma_weights(w, cfg) is not None) == (tma == "on")
            y = torch.zeros(b, n // 2 if epi == G.EPI_GATED else n, device="cuda",
                            dtype=torch.float32 if epi == G.EPI_RESIDUAL else torch.bfloat16)
            ys.append(G.gemv(x, w, bias, y, epi, n_split=6144 if epi == 1 else 0, cfg=cfg,
                             deterministic=True))
    finally:
        G.TMA = keep
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graphed_reference_encode_is_bitwise(dtype):
    """encoder="reference": Moondream 2's encode as one CUDA graph per crop tiling
    (graphed_reference_encoder.py over MoondreamModel's split encode) - the k/v of the
    capturing frame, of a replayed one and of another tiling are the reference
    encode_image's, bit for bit."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype=dtype, seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, max_batch=1, encoder="reference")
    pairs = graphed_encodes(fe, m, ((120, 160, 3), (120, 160, 3), (378, 1000, 3)))
    assert pairs[0][0].tiling != pairs[2][0].tiling
    for enc, ref in pairs:
        assert enc.tiling == ref.tiling and torch.equal(enc.kv, ref.kv)
    assert pairs[0][0].kv.data_ptr() != pairs[1][0].kv.data_ptr()
    fe.close()
