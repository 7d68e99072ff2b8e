"""bench_kernels.py's `logits_prefill_rel` (0.25 on the H200 between an engine built with
fused="off" and one with "on"): the lm logits right after the prompt prefill.

Cause: every CUDA graph of every FastEngine was captured on torch.cuda.graph's one
process-wide default capture stream, and PyTorch keys the cuBLAS workspace by (handle,
stream), so all those graphs baked in ONE workspace address. The bench starts a run in each
engine back to back (each engine's own compute stream, no sync between): the two graphed
prefills ran at the same time and corrupted each other's GEMMs (both engines' hidden states
wrong, not only the fused one's). The fix captures each engine's graphs on a stream of its own
(FastEngine.capture_stream, passed as torch.cuda.graph(stream=...) by every capture).

  - CPU: the fake-CUDA test checks that mechanism (fails when the engines share a capture
    stream); the bench's sequence on the tiny fp32 model (interpreted Triton kernels) checks
    that the fused and the torch lm head agree on the same prefill state.
  - GPU (skipped without CUDA): the race itself, at the real shapes in bf16.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- fake CUDA: capture bookkeeping only (the captured functions run eagerly on the CPU) ----
class _FakeStream:
    count = 0

    def __init__(self, device=None, priority=0):
        _FakeStream.count += 1
        self.id = _FakeStream.count

    def wait_stream(self, other) -> None:
        pass

    def __eq__(self, other):
        return isinstance(other, _FakeStream) and other.id == self.id

    __hash__ = object.__hash__


class _FakeCUDAGraph:
    def replay(self) -> None:
        pass


def _fake_graph_class(captures: list):
    class graph:   # noqa: N801 - torch.cuda.graph, with its default-capture-stream rule
        default_capture_stream = None

        def __init__(self, cuda_graph, pool=None, stream=None, **kwargs):
            if stream is None and type(self).default_capture_stream is None:
                type(self).default_capture_stream = _FakeStream()
            self.capture_stream = stream if stream is not None else \
                type(self).default_capture_stream

        def __enter__(self):
            captures.append(self.capture_stream)

        def __exit__(self, *exc):
            return False
    return graph


def test_each_engine_captures_its_graphs_on_its_own_stream(monkeypatch):
    """Two graphed engines in one process: every capture of an engine (decode pieces, prompt
    prefill, encoder) on one stream, and no stream shared between the engines (a shared
    capture stream means a shared cuBLAS workspace in every captured GEMM)."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config

    captures: list = []
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_graph_class(captures))

    m = build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    per_engine = []
    engines = []
    for _ in range(2):
        captures.clear()
        fe = FastEngine(m, max_batch=2, use_graphs=True)   # warm-up captures
        first = fe.encode_image(frame)                      # the encoder's tiling capture
        again = fe.encode_image(frame)
        # the capture is reported as one-time setup (schedulers leave it out of the cost)
        assert 0 < first.setup_ms <= first.encode_ms and again.setup_ms == 0.0
        engines.append(fe)
        per_engine.append(list(captures))
    for caps in per_engine:
        assert len(caps) > 5                    # decode pieces + prefill buckets + encoder
        assert all(c == caps[0] for c in caps[1:])
    assert per_engine[0][0] != per_engine[1][0], "two engines captured on one stream"
    for fe in engines:
        fe.close()


@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="interpreted Triton kernels on CPU tensors")
def test_bench_sequence_fused_and_torch_logits_agree_after_prefill():
    """bench_kernels.correctness on the tiny fp32 model: engines built with fused="off" and
    "on", both prefill the same query; the logits right after the prefill (fused lm head vs
    torch lm head, same hidden state) and after one forward agree to fp32 rounding."""
    pytest.importorskip("triton")
    from photon_core.fast import FastEngine
    from photon_core.fast import decode_step as ds
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)
    engines = {mode: FastEngine(m, max_batch=8, fused=mode) for mode in ("off", "on")}
    prev, fused = engines["off"], engines["on"]
    assert fused.state.fused is not None and prev.state.fused is None
    enc = prev.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3),
                                                              dtype=np.uint8))
    t = Task("query", question="What is in the image?", max_tokens=40)
    r_p = prev.start(enc, t, ignore_eos=True)
    r_f = fused.start(enc, t, ignore_eos=True)

    def rel(a, b):
        ok = torch.isfinite(a) & torch.isfinite(b)
        return ((a[ok] - b[ok]).abs().max() / a[ok].abs().max()).item()

    with torch.inference_mode():
        # the fused engine prefills with its own kernels (graphed_prefill.py, FUSED_MAX_T):
        # fp32 rounding apart; the lm heads are then compared on the SAME hidden state
        assert rel(prev.state.hidden[:1], fused.state.hidden[:1]) < 1e-5
        fused.state.hidden[0] = prev.state.hidden[0]
        lp = ds._lm_logits(prev.state, 1).float().clone()
        lf = ds._lm_logits(fused.state, 1).float().clone()
        assert rel(lp, lf) < 1e-5
        tok = lp.argmax().item()
        for e in (prev, fused):
            e.state.active.zero_()
            e.state.out[:1] = torch.tensor([[tok, 0, 0, 0]])
            e.state.active[:1] = True
            ds.forward(e.state, 1)
        assert rel(prev.state.hidden[:1], fused.state.hidden[:1]) < 1e-5
        assert rel(ds._lm_logits(prev.state, 1).float(), ds._lm_logits(fused.state, 1).float()) < 1e-5
    for r in (r_p, r_f):
        r.cancel()
    for e in (prev, fused):
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_concurrent_prefills_of_two_engines_gpu(monkeypatch):
    """Real Moondream 2 shapes, bf16, random weights, bench_kernels' engines (batch 8, KV 832):
    prefills started back to back in two engines (their own streams, no sync between) give
    each engine's solo result bit for bit. Captured on one shared stream they raced on one
    cuBLAS workspace (hidden states off by ~6)."""
    from photon_core.fast import FastEngine
    from photon_core.moondream.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model
    from photon_core.task import Task

    from photon_core.fast import graphed_prefill
    # the torch prefill (cuBLAS GEMMs, bitwise deterministic); the fused one adds its split-K
    # residual GEMV with fp32 atomics, whose sum order varies from run to run
    monkeypatch.setattr(graphed_prefill, "FUSED_MAX_T", 0)
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    a, b = FastEngine(m, max_batch=8, kv_capacity=832), FastEngine(m, max_batch=8, kv_capacity=832)
    enc = a.encode_image(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    task = Task("query", question="What is in the image?", max_tokens=40)

    def hidden(e, r):
        return e.state.hidden[r.row].clone()

    solo = []
    for e in (a, b):
        torch.cuda.synchronize()
        r = e.start(enc, task, ignore_eos=True)
        torch.cuda.synchronize()
        solo.append(hidden(e, r))
        r.cancel()
        e.drain()
    assert torch.equal(solo[0], solo[1])
    for _ in range(3):
        torch.cuda.synchronize()
        ra, rb = a.start(enc, task, ignore_eos=True), b.start(enc, task, ignore_eos=True)
        torch.cuda.synchronize()
        ha, hb = hidden(a, ra), hidden(b, rb)
        for r in (ra, rb):
            r.cancel()
        a.drain()
        b.drain()
        assert torch.equal(ha, solo[0]), (ha.float() - solo[0].float()).abs().max().item()
        assert torch.equal(hb, solo[1]), (hb.float() - solo[1].float()).abs().max().item()
    a.close()
    b.close()
