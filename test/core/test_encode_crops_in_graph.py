"""The image crops inside the encode graph (fast/graphed_batch_encoder.py, crops_in_graph),
on the CPU with the tiny fp32 model: an entry's body run eagerly from the uint8 frame gives
bitwise the crops (x) and k/v of today's path (model.image_crops outside, copied into the
static crops input); the plans behind it (pil_resize.ResizePlan, crops.CropPlan) are the
functions image_crops uses and need no table look-up when run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from photon_core.encode_request import EncodeRequest
from photon_core.fast import FastEngine
from photon_core.fast.graphed_batch_encoder import GraphedBatchEncoder
from photon_core.models.moondream2 import crops as C
from photon_core import pil_resize as L
from photon_core.models.moondream2.batched_encode import pixel_layout
from photon_core.models.moondream2.image_input import ImageError
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config

# tilings (tiny model: 84 px crops, at most 4): (1, 2) of two sizes, (1, 1), (2, 2), and a
# second 120 x 160 frame
SIZES = ((120, 160), (90, 200), (60, 60), (250, 250), (120, 160))


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


class _FakeGraphs(GraphedBatchEncoder):
    """Graph entries without CUDA: captured = kept, its body run eagerly at every call."""

    def _capture(self, e):
        self.captured.append(e.layouts)
        return None


def _encoder(model, in_graph: bool, **kw) -> _FakeGraphs:
    enc = _FakeGraphs(model, use_graphs=True, crops_in_graph=in_graph, **kw)
    enc.captured = []
    return enc


def _same(a, b) -> bool:
    return (torch.equal(a.kv, b.kv) and (a.width, a.height, a.tiling, a.crops, a.n_crops)
            == (b.width, b.height, b.tiling, b.crops, b.n_crops))


def test_default_is_off_on_the_cpu(model):
    assert not GraphedBatchEncoder(model, use_graphs=True).crops_in_graph
    assert not GraphedBatchEncoder(model, use_graphs=False).crops_in_graph
    fe = FastEngine(model, max_batch=2)
    assert fe.batch_encoder.summary()["crops_in_graph"] is False
    fe.close()


@pytest.mark.parametrize("mode", ["overlap", "global"])
def test_single_frame_entry_bitwise_as_eager_crops(model, images, mode):
    """One frame per call: the in-graph entry's crops (x) are image_crops' (PIL on the CPU
    and the torch crops alike) and its k/v are the eager-crops entry's, bit for bit."""
    new, old = _encoder(model, True), _encoder(model, False)
    for img in images:
        a = new.encode_batch([EncodeRequest(img, mode)])[0]
        b = old.encode_batch([EncodeRequest(img, mode)])[0]
        assert _same(a, b)
        (key_new,) = [k for k in new.entries if k[0].size == img.shape[:2]]
        e_new = new.entries[key_new]
        e_old = next(e for k, e in old.entries.items()
                     if k[0].tiling == key_new[0].tiling and k[0].crops == mode)
        _, x_pil, tiling = model.image_crops(img, mode)
        model.crops_on_device = True                     # the torch crops (as on CUDA)
        try:
            _, x_torch, tiling_t = model.image_crops(img, mode)
        finally:
            model.crops_on_device = None
        assert torch.equal(e_new.x, x_pil) and torch.equal(e_new.x, x_torch)
        assert torch.equal(e_new.x, e_old.x) and e_new.x.stride() == e_old.x.stride()
        assert key_new[0].tiling == tuple(tiling) == tuple(tiling_t)
        assert key_new[0].n_crops == x_pil.shape[0]
        assert e_new.frames is not None and e_old.frames is None
    # a layout per frame size: the two 120 x 160 frames share one, the (1, 2) tilings of
    # 120 x 160 and 90 x 200 do not (they share one eager-crops entry)
    assert len(new.entries) == len(SIZES) - 1
    assert len(old.entries) == (3 if mode == "overlap" else 1)
    assert all(len(k) == 1 and k[0].size is not None for k in new.captured)


def test_batched_entries_bitwise_as_eager_crops(model, images):
    """Several frames in one entry (captured the second time, canonical order), split over
    captured sizes and frame by frame: the same k/v as the eager-crops path."""
    new, old = _encoder(model, True, max_frames=4), _encoder(model, False, max_frames=4)
    batch = [images[0], EncodeRequest(images[1], "global"), images[3], images[2]]
    for i in range(3):          # frame by frame, captured, replayed
        a, b = new.encode_batch(batch), old.encode_batch(batch)
        assert all(_same(x, y) for x, y in zip(a, b))
        if i == 0:
            assert new.counts["frame_by_frame"] == 1 and new.n_batch_graphs() == 0
    assert new.counts["batched"] == 2 and new.n_batch_graphs() == 1
    # the same frames in another order: the one (canonical) graph, results in caller order
    rev = new.encode_batch(batch[::-1])
    assert new.n_batch_graphs() == 1 and new.counts["batched"] == 3
    assert all(_same(x, y) for x, y in zip(rev, b[::-1]))
    # k frames of one size: split over the prepared sizes (3 = 2 + 1)
    new.prepare(shapes=(SIZES[0],), batch_sizes=(1, 2))
    assert all(k[0].size == SIZES[0] for k in new.captured[-1:])
    three = new.encode_batch([images[0], images[4], images[0]])
    assert new.counts["split"] == 1
    ref = old.encode_batch([images[0], images[4]])
    assert _same(three[0], ref[0]) and _same(three[1], ref[1]) and _same(three[2], ref[0])


def test_eager_encoder_and_frame_inputs(model, images):
    """Graphs off with crops_in_graph: the same body run on fresh buffers each call; PIL
    images and read-only arrays go in; a bad image is a clear error."""
    eager = GraphedBatchEncoder(model, use_graphs=False, crops_in_graph=True)
    ref = _encoder(model, False)
    img = images[3]
    assert _same(eager.encode(img), ref.encode(img))
    assert not eager.entries
    ro = img.copy()
    ro.flags.writeable = False
    pil = Image.fromarray(img)
    assert _same(eager.encode(ro), ref.encode(img))
    assert _same(eager.encode(pil, "global"), ref.encode(img, "global"))
    with pytest.raises(ImageError):
        eager.encode(np.zeros((10, 10), np.uint8))
    with pytest.raises(ImageError):
        eager.encode(np.zeros((10, 10, 3), np.float32))


def test_prepare_in_graph_layouts(model, images):
    enc = _encoder(model, True, max_batch_graphs=1, max_frames=4)
    assert enc.prepare(shapes=(SIZES[0],), batch_sizes=(1, 2, 4),
                       crops=("overlap", "global")) == 3            # 2 singles + 1 batch
    assert {k[0].size for k in enc.entries} == {SIZES[0]}
    n = enc.counts["captures"]
    out = enc.encode_batch([images[0], images[4]])                    # both 120 x 160
    assert enc.counts["batched"] == 1 and enc.counts["captures"] == n
    ref = _encoder(model, False).encode_batch([images[0], images[4]])
    assert all(_same(a, b) for a, b in zip(out, ref))


def test_pixel_layout_is_image_crops_layout(model, images):
    for img in images + [np.zeros((378, 1000, 3), np.uint8), np.zeros((1, 1, 3), np.uint8)]:
        for mode in ("overlap", "global", "overlap:1"):
            _, x, tiling = model.image_crops(img, mode)
            lay = pixel_layout(model, *img.shape[:2], mode)
            assert (lay.tiling, lay.n_crops, lay.crops) == (tuple(tiling), x.shape[0], mode)
            assert lay.size == img.shape[:2]
    with pytest.raises(ValueError, match="unknown crops mode"):
        pixel_layout(model, 10, 10, "tiles")


def test_plans_are_the_crops_and_need_no_lookup(monkeypatch):
    """ResizePlan / CropPlan = resize_lanczos / overlap_crops_tensor / global_crop_tensor,
    and once made they look up no table (in a capture that would be a host->device copy)."""
    rng = np.random.default_rng(3)
    frame = torch.from_numpy(rng.integers(0, 256, (97, 251, 3), dtype=np.uint8))
    plans = [L.ResizePlan(97, 251, h, w, "cpu") for h, w in ((40, 60), (97, 80), (300, 251),
                                                            (97, 251))]
    crop_plans = [C.CropPlan(97, 251, mode, 84, 14, 1, 4, "cpu")
                  for mode in ("overlap", "global")]
    want_resize = [L.resize_lanczos(frame, *p.out_shape) for p in plans]
    want_crops = [C.overlap_crops_tensor(frame, 84, 14, 1, 4)[0],
                  C.global_crop_tensor(frame, 84)]

    def no_lookup(*a, **k):
        raise AssertionError("a table looked up while running a plan")
    monkeypatch.setattr(L, "_device_tables", no_lookup)
    for p, want in zip(plans, want_resize):
        got = p(frame)
        assert torch.equal(got, want) and got.data_ptr() != frame.data_ptr()
    for p, want in zip(crop_plans, want_crops):
        assert torch.equal(p(frame), want)
    assert crop_plans[0].tiling == C.overlap_crops(frame.numpy(), 84, 14, 1, 4)[1]
    assert crop_plans[1].tiling == C.GLOBAL_TILING and crop_plans[1].n_crops == 1
    with pytest.raises(ValueError, match="plan resizes"):
        plans[0](frame[:50])
    with pytest.raises(ValueError, match="uint8"):
        plans[0](frame.float())
    with pytest.raises(ValueError):
        L.ResizePlan(0, 10, 5, 5, "cpu")


def test_frame_sizes_bound(model, images):
    """At most max_frame_sizes frame sizes get in-graph crops (graphs of their own); a
    batch with a frame of another size has its crops made outside (the per-tiling graphs),
    with the same k/v."""
    enc = _encoder(model, True, max_frame_sizes=2)
    ref = _encoder(model, False)
    a, b, c = images[0], images[1], images[3]            # three sizes
    for img in (a, b):
        assert _same(enc.encode(img), ref.encode(img))
    assert enc.frame_sizes == {a.shape[:2], b.shape[:2]} and enc.counts["crops_outside"] == 0
    assert _same(enc.encode(c), ref.encode(c))
    assert enc.counts["crops_outside"] == 1
    assert any(k[0].size is None for k in enc.entries)
    got = enc.encode_batch([a, c])                         # c's size: the whole batch outside
    assert enc.counts["crops_outside"] == 2
    assert _same(got[0], ref.encode(a)) and _same(got[1], ref.encode(c))
    assert enc.prepare(shapes=(c.shape[:2],), batch_sizes=(1,), crops=("global",)) == 1
    assert enc.frame_sizes == {a.shape[:2], b.shape[:2]}   # prepared outside too
    assert len({k[0].size for k in enc.entries if k[0].size is not None}) == 2
    eager = GraphedBatchEncoder(model, use_graphs=False, crops_in_graph=True,
                                max_frame_sizes=1)
    for img in (a, b, c):                                   # nothing kept: no bound
        assert _same(eager.encode(img), ref.encode(img))
    assert eager.counts["crops_outside"] == 0
