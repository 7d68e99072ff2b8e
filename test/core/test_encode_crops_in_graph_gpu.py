"""The crops inside the encode graph on a GPU (skipped without CUDA): Moondream 2's real
shapes, random bf16 weights; FastEngine's graphed encode with the crops in the graph gives
bitwise the k/v of the same engine with the crops made outside the graph (the path as it
was), for 640x480 and 1280x720 frames, crops="overlap", "global" and "overlap:4", one frame and several
cameras in one graph; the graph's crops are model.image_crops' bit for bit; loading a frame
and replaying its graph makes no host sync."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZES = ((480, 640), (720, 1280))


@pytest.fixture(scope="module")
def engine():
    from photon_core.fast import FastEngine
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    fe = FastEngine(m, max_batch=4)
    yield m, fe
    fe.close()


def _frame(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encode(fe, image, mode, in_graph: bool):
    be = fe.batch_encoder
    be.crops_in_graph = in_graph
    try:
        return [fe.encode_image(image, crops=mode) for _ in range(2)]   # captured, replayed
    finally:
        be.crops_in_graph = True


@pytest.mark.parametrize("mode", ["overlap", "global", "overlap:4"])
@pytest.mark.parametrize("size", SIZES)
def test_in_graph_crops_bitwise_as_eager_crops(engine, size, mode):
    m, fe = engine
    be = fe.batch_encoder
    assert be.crops_in_graph and fe.fast_encode          # the default on CUDA
    frame = _frame(*size)
    new = _encode(fe, frame, mode, True)
    old = _encode(fe, frame, mode, False)
    for a in new:
        for b in old:
            assert torch.equal(a.kv, b.kv)
            assert (a.width, a.height, a.tiling, a.crops, a.n_crops) == \
                (b.width, b.height, b.tiling, b.crops, b.n_crops)
    key = next(k for k in be.entries if len(k) == 1 and k[0].size == size
               and k[0].crops == mode)
    e = be.entries[key]
    assert e.graph is not None and e.frames is not None
    _, x, tiling = m.image_crops(frame, mode)          # the crops the graph made, bitwise
    assert torch.equal(e.x, x) and tuple(tiling) == key[0].tiling
    # another frame through the same graph: its own crops and k/v
    other = _frame(*size, seed=5)
    a, b = _encode(fe, other, mode, True)[1], _encode(fe, other, mode, False)[1]
    assert torch.equal(a.kv, b.kv) and not torch.equal(a.kv, new[0].kv)


def test_cameras_batched_in_one_graph_bitwise(engine):
    """Frames of three cameras (two sizes, both modes) in one graph: the same k/v per frame
    as the frames batched with their crops made outside the graph."""
    from photon_core.encode_request import EncodeRequest

    m, fe = engine
    be = fe.batch_encoder
    batch = [_frame(480, 640, 1), EncodeRequest(_frame(720, 1280, 2), "global"),
             _frame(480, 640, 3)]
    outs = {}
    for in_graph in (True, False):
        be.crops_in_graph = in_graph
        before = be.counts["batched"]
        try:
            for _ in range(3):                  # frame by frame, captured, replayed
                outs[in_graph] = fe.encode_batch(batch)
        finally:
            be.crops_in_graph = True
        assert be.counts["batched"] == before + 2
    assert any(len(k) == 3 and k[0].size is not None for k in be.entries)
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a.kv, b.kv) and (a.width, a.tiling, a.crops) == \
            (b.width, b.tiling, b.crops)
    # and each frame as its own single-frame encode gives (close: other GEMM row counts)
    single = fe.encode_image(batch[0])
    err = (single.kv.float() - outs[True][0].kv.float()).abs().max().item()
    assert err <= 5e-2 * single.kv.float().abs().max().item(), err


def test_load_and_replay_make_no_host_sync(engine):
    """A prepared layout: the frame's copy-in (pinned, non_blocking) and the replay of the
    graph that makes its crops raise nothing under torch's sync debug mode "error"."""
    m, fe = engine
    be = fe.batch_encoder
    fe.prepare_encode(shapes=((480, 640),), batch_sizes=(1,))
    key = next(k for k in be.entries if len(k) == 1 and k[0].size == (480, 640)
               and k[0].crops == "overlap")
    frame = _frame(480, 640, 9)
    ref = _encode(fe, frame, "overlap", False)[1]
    m.image_crops(frame)                       # the eager path's tables exist
    torch.cuda.synchronize()
    with torch.cuda.stream(fe.stream), torch.inference_mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            kv = be._run(key, [(0, frame, None, key[0])])
            m.image_crops(frame)               # the eager crops: pinned upload, no sync
        finally:
            torch.cuda.set_sync_debug_mode(0)
        got = kv[:, :, 0:1].clone()
    torch.cuda.synchronize()
    assert torch.equal(got, ref.kv)


def test_start_of_an_image_does_not_wait_for_its_encode(engine, monkeypatch):
    """start() of an image: the encode is queued without a host wait (no stream
    synchronize: the prefill follows on the same stream), the row then holds bitwise the
    k/v of the synchronously encoded image (no race with the encode), the run finishes,
    and its encode_ms is the encode's GPU time (CUDA events), not the host's."""
    from photon_core.task import Task

    m, fe = engine
    frame = _frame(480, 640, 4)
    task = Task("detect", object="person", max_objects=3)
    ref = fe.encode_image(frame)
    waits = []
    real = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: (waits.append(self), real(self))[1])
    run = fe.start(frame, task)
    assert waits == []
    torch.cuda.synchronize()
    t = ref.kv.shape[4]
    assert torch.equal(fe.kv.data[:, :, run.row:run.row + 1, :, :t], ref.kv)
    while not run.finished:
        run.step()
    fe.drain()
    res = run.result()
    assert res.finish_reason in ("stop", "length") and res.timings["encode_ms"] > 0.5
    enc = fe.encode_image(frame, sync=False)
    assert enc.gpu_timing is not None and ref.gpu_timing is None
    # (its k/v are ready in the engine stream's order: read them after its end event)
    assert 0.5 < enc.gpu_encode_ms() < 1000 and torch.equal(enc.kv, ref.kv)


def test_encode_graph_cut_in_two_parts_bitwise_as_one(monkeypatch):
    """vision_fused.CUT_AFTER_BLOCK: the captured encode is two graphs (the first ends after
    that vision block) replayed in order; the k/v are bitwise one graph's (a fresh engine of
    each form on one model), for a first capture and a replay with another frame."""
    from photon_core import weight_layout
    from photon_core.fast import FastEngine
    from photon_core.fast.cuda_graph_runner import GraphParts
    from photon_core.models.moondream2 import vision_fused
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=1)
    outs = {}
    for cut in (0, None):
        monkeypatch.setattr(vision_fused, "CUT_AFTER_BLOCK", cut)
        fe = FastEngine(m, max_batch=1)
        outs[cut] = [fe.encode_image(_frame(480, 640, s)).kv.clone() for s in (0, 7, 0)]
        (e,) = fe.batch_encoder.entries.values()
        assert isinstance(e.graph, GraphParts) == (cut is not None)
        # the captured graph reads the vision weights by address: held (weight_layout)
        assert weight_layout.held([m.weights["vision.blocks.0.attn.qkv.weight"]])
        if cut is not None:
            assert len(e.graph.graphs) == 2
        fe.close()
    for a, b in zip(outs[0], outs[None]):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][0], outs[0][2]) and not torch.equal(outs[0][0], outs[0][1])
