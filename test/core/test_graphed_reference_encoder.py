"""fast/graphed_reference_encoder.py on the CPU: a layout whose CUDA graph capture fails runs
eagerly - the reference's encode, bit for bit - and the reason is kept (capture_errors) instead
of the encode failing. The CUDA calls are stand-ins here (no GPU); the capture and replay
themselves are tested on the GPU (test_qwen3_5_fast_gpu.py, test_gemma4_fast_gpu.py,
test_fast_gpu.py)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from photon_core.fast.graphed_reference_encoder import GraphedReferenceEncoder
from photon_core.models import qwen3_5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path_factory.mktemp("gre"),
                                                          seed=5)))


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    def replay(self):
        raise AssertionError("a graph that failed to capture is never replayed")


@contextlib.contextmanager
def _failing_capture(graph, pool=None, stream=None, capture_error_mode="global"):
    yield
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def test_a_layout_that_cannot_be_captured_runs_eagerly(model, monkeypatch):
    for name, value in (("Stream", _Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", _Stream), ("synchronize", lambda: None),
                        ("CUDAGraph", _Graph), ("graph", _failing_capture)):
        monkeypatch.setattr(torch.cuda, name, value)
    enc = GraphedReferenceEncoder(model, use_graphs=True)
    frame = np.random.default_rng(2).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    for _ in range(2):                   # the failed layout is not captured again
        got, ref = enc.encode(frame), model.encode_image(frame)
        for i in ref.state.k:
            assert torch.equal(got.state.k[i], ref.state.k[i])
        for i in ref.state.recurrent:
            assert torch.equal(got.state.recurrent[i], ref.state.recurrent[i])
    (key, why), = enc.capture_errors.items()
    assert why == "operation not permitted when stream is capturing"
    assert enc.entries[key].graph is None and enc.encode(got) is got


class _Captured:
    def replay(self):
        pass


def test_layouts_past_the_cap_run_eagerly(model, monkeypatch):
    """At most MAX_LAYOUTS layouts get a graph; a frame of a further layout runs the body
    eagerly (the reference's encode, bit for bit) and is counted, and no entry is kept for
    it (bounded GPU memory for a stream of ever-new frame sizes)."""
    from photon_core.fast import graphed_reference_encoder as gre
    for name, value in (("Stream", _Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", _Stream), ("synchronize", lambda: None),
                        ("CUDAGraph", _Captured),
                        ("graph", lambda g, **kw: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(gre, "MAX_LAYOUTS", 2)
    enc = GraphedReferenceEncoder(model, use_graphs=True)
    rng = np.random.default_rng(3)
    for h, w in ((64, 64), (96, 128), (64, 64)):        # two layouts: graphs
        enc.encode(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    assert len(enc.entries) == 2 and enc.eager_encodes == 0
    frame = rng.integers(0, 256, (128, 96, 3), dtype=np.uint8)   # a third layout
    got, ref = enc.encode(frame), model.encode_image(frame)
    assert len(enc.entries) == 2 and enc.eager_encodes == 1
    from photon_core.fast import FastEngine
    fe = FastEngine(model, max_batch=1, kv_capacity=64)      # its counters, for diagnostics
    assert fe.fallbacks() == {"encoder_capture_errors": 0, "prefill_capture_errors": 0,
                              "encoder_eager_encodes": 0, "megakernel_fallback": ""}
    fe.encoder = enc
    assert fe.fallbacks()["encoder_eager_encodes"] == 1
    assert fe.metrics()["encoder_eager_encodes"] == 1
    fe.close()
    for i in ref.state.k:
        assert torch.equal(got.state.k[i], ref.state.k[i])
    for i in ref.state.recurrent:
        assert torch.equal(got.state.recurrent[i], ref.state.recurrent[i])


def test_replay_reads_each_frames_inputs(model, monkeypatch):
    """A replay reads the new frame's inputs (copied into the graph's static inputs) while the
    model's per-layout tensors (the same objects every frame) are not copied again: two
    different frames of one layout, through a stand-in graph whose replay reruns the body on
    the static inputs, give the reference encode's state each."""
    from photon_core.fast import graphed_reference_encoder as gre
    for name, value in (("Stream", _Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", _Stream), ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)

    class Replay:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):                    # rerun the body, into the captured output
            new = self.fn()
            for part in ("k", "v", "conv", "recurrent"):
                for i, t in getattr(new, part).items():
                    getattr(self.out, part)[i].copy_(t)

    def capture(fn, stream=None):
        out = fn()
        return Replay(fn, out), out
    monkeypatch.setattr(gre, "capture_graph", capture)
    copied = []
    enc = GraphedReferenceEncoder(model, use_graphs=True)
    rng = np.random.default_rng(5)
    frames = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(2)]
    got = [enc.encode(frames[0])]
    (e,) = enc.entries.values()
    for k, t in e.inputs.tensors.items():
        monkeypatch.setattr(t, "copy_", lambda src, k=k, t=t: (copied.append(k),
                                                               torch.Tensor.copy_(t, src))[1])
    got.append(enc.encode(frames[1]))
    assert copied == ["image"]               # the per-layout ids / positions / table: kept
    for g, f in zip(got, frames):
        ref = model.encode_image(f)
        for i in ref.state.k:
            assert torch.equal(g.state.k[i], ref.state.k[i])
        for i in ref.state.recurrent:
            assert torch.equal(g.state.recurrent[i], ref.state.recurrent[i])


def test_encode_without_host_wait_records_events_instead_of_syncing(model, monkeypatch):
    """sync=False (stand-ins for the CUDA calls): the replay is bracketed by two recorded
    events handed to encode_result as gpu_timing (share 1), no device synchronize runs,
    and gpu_encode_ms() reads the events; sync=True synchronizes and carries none."""
    from photon_core.fast import graphed_reference_encoder as gre
    syncs, log = [], []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            log.append("record")
            self.t = len(log)

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return float(end.t - self.t)

    class Graph:
        def replay(self):
            log.append("replay")
    from photon_core.models.qwen3_5 import model as qwen_model
    for name, value in (("Stream", _Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("current_stream", _Stream), ("Event", Event),
                        ("synchronize", lambda *a: None)):     # (the warm-up's)
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(qwen_model, "_sync", lambda device: syncs.append(1))
    monkeypatch.setattr(gre, "capture_graph", lambda fn, stream=None, pool=None:
                        (Graph(), fn()))
    enc = GraphedReferenceEncoder(model, use_graphs=True)
    frame = np.random.default_rng(4).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    enc.encode(frame)                          # the capture
    syncs.clear()
    log.clear()
    got = enc.encode(frame, sync=False)
    assert syncs == [] and log == ["record", "replay", "record"]
    start, end, share = got.gpu_timing
    assert share == 1.0 and got.gpu_encode_ms() == 2.0 and log[-1] == "wait"
    waited = enc.encode(frame)
    assert waited.gpu_timing is None and syncs == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_gpu_encode_without_host_wait(family, tmp_path):
    """encode(image, sync=False) (FastEngine.start of an image, the scheduler's queued
    encodes): the replay is only queued, the encoding carries gpu_timing, its GPU time is
    readable, and a task on it gives the result of the synchronized encode."""
    import importlib
    from photon_core.fast import FastEngine
    from photon_core.task import Task
    fam = importlib.import_module(f"photon_core.models.{family}")
    m = fam.load_model(str(fam.make_test_model(tmp_path / family, seed=5)), device="cuda")
    fe = FastEngine(m, max_batch=2, kv_capacity=1024)
    try:
        frame = np.random.default_rng(3).integers(0, 256, (96, 128, 3), dtype=np.uint8)
        task = Task("query", question="What is it?", max_tokens=6)
        ref = fe.run(fe.encode_image(frame), task, ignore_eos=True)    # (captures)
        enc = fe.encode_image(frame, sync=False)
        assert enc.gpu_timing is not None and enc.gpu_encode_ms() > 0
        assert fe.encode_image(frame).gpu_timing is None
        got = fe.run(frame, task, ignore_eos=True)                      # start(): sync=False
        assert (got.output, got.tokens) == (ref.output, ref.tokens)
        assert fe.run(enc, task, ignore_eos=True).output == ref.output
    finally:
        fe.close()


def test_upload_frame_keeps_the_pixels():
    """split_encode.upload_frame (the families' encode_inputs): the frame's pixels, C
    order, on the device (CUDA: through pinned memory, non_blocking - read back here)."""
    from photon_core.split_encode import upload_frame
    a = np.random.default_rng(1).integers(0, 256, (5, 7, 3), dtype=np.uint8)[:, ::-1]
    t = upload_frame(a, "cpu")
    assert t.dtype == torch.uint8 and t.is_contiguous() and np.array_equal(t.numpy(), a)
    if torch.cuda.is_available():
        g = upload_frame(a, "cuda")
        assert g.is_cuda and np.array_equal(g.cpu().numpy(), a)
