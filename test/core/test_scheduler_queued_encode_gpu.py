"""Queued encodes on a GPU (skipped without CUDA): the scheduler driving FastEngine (Moondream
2's real shapes, random bf16 weights) encodes with sync=False - the encodings carry CUDA
events - and its frames' encode_ms, engine_ms and cost model get the encode's GPU time (the
events'), not the host's queueing time; the k/v are bitwise the synchronous encode's; the
batched path (several cameras in one call) gives each frame its share. An engine instance with
queued_encode switched off is driven exactly as before (the A/B switch for bench_live)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def fe():
    from photon_core.fast import FastEngine
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model

    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    eng = FastEngine(m, max_batch=4)
    eng.prepare_encode(shapes=((480, 640),), batch_sizes=(1, 2, 4))
    yield eng
    eng.close()


def _frame(seed):
    return np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)


class _Spy:
    """Wraps the engine instance's encode_image / encode_batch: records (sync, encodings)."""

    def __init__(self, fe, monkeypatch):
        self.calls = []
        ei, eb = fe.encode_image, fe.encode_batch

        def encode_image(image, crops=None, sync=True):
            out = ei(image, crops, sync)
            if out is not image:            # (start() passes an encoded image through)
                self.calls.append((sync, [out]))
            return out

        def encode_batch(images, crops=None, sync=True):
            out = eb(images, crops, sync)
            self.calls.append((sync, list(out)))
            return out
        monkeypatch.setattr(fe, "encode_image", encode_image)
        monkeypatch.setattr(fe, "encode_batch", encode_batch)


def _run(fe, frames, queued: bool, monkeypatch):
    from photon_core.scheduler import CostModel, Policy, Scheduler, Status
    from photon_core.task import Task

    monkeypatch.setattr(fe, "queued_encode", queued, raising=False)
    spy = _Spy(fe, monkeypatch)
    cost = CostModel(ema=0.1)
    outs = []
    s = Scheduler(fe, cost, policy=Policy(max_batch=4, probe_after_s=0.0), on_result=outs.append)
    task = Task("detect", object="person", max_objects=5)
    for cam, f in enumerate(frames):
        s.submit_frame(f"cam{cam}", 0, f, [("det", task, 30.0)])
    s.run_until_idle()
    assert [o.status for o in outs] == [Status.DONE] * len(frames)
    assert not s._pending
    monkeypatch.undo()
    return s, outs, spy.calls


def test_one_frame_queued_encode_learns_the_gpu_time(fe, monkeypatch):
    frame = _frame(0)
    s, outs, calls = _run(fe, [frame], True, monkeypatch)
    ((sync, (enc,)),) = calls
    assert sync is False and enc.gpu_timing is not None
    gpu = enc.gpu_encode_ms()
    assert gpu > 0
    (o,) = outs
    assert o.timings["encode_ms"] == pytest.approx(gpu)
    assert s.metrics()["engine_ms"]["encode"] == pytest.approx(gpu, abs=1e-3)
    from photon_core.scheduler.cost_model import encode_key
    assert s.cost.encode_seen[encode_key(frame)] == pytest.approx(gpu - enc.setup_ms)
    print(f"\nqueued encode: host {enc.encode_ms:.3f} ms, GPU {gpu:.3f} ms")
    # the synchronous path (queued_encode off on this instance): the same k/v, bit for bit
    s2, outs2, calls2 = _run(fe, [frame], False, monkeypatch)
    ((sync2, (enc2,)),) = calls2
    assert sync2 is True, calls2
    assert enc2.gpu_timing is None
    assert torch.equal(enc.kv, enc2.kv)
    print(f"synchronous encode: {enc2.encode_ms:.3f} ms (the scheduler's clock: "
          f"{outs2[0].timings['encode_ms']:.3f} ms)")


def test_batched_queued_encode_gives_each_frame_its_share(fe, monkeypatch):
    frames = [_frame(k) for k in range(3)]
    s, outs, calls = _run(fe, frames, True, monkeypatch)
    assert all(sync is False for sync, _ in calls)
    encs = [e for _, es in calls for e in es]
    assert len(encs) == 3 and all(e.gpu_timing is not None for e in encs)
    shares = sorted(e.gpu_encode_ms() for e in encs)
    assert sorted(o.timings["encode_ms"] for o in outs) == pytest.approx(shares)
    assert s.metrics()["engine_ms"]["encode"] == pytest.approx(sum(shares), abs=1e-3)
    print(f"\nencode calls {s.metrics()['encode_batches']}, per frame GPU ms "
          f"{[round(x, 3) for x in shares]}")
