"""Batched image encode (models/moondream2/batched_encode.py, fast/graphed_batch_encoder.py),
crop modes (encode_request.py) and the faster encode forms, on the CPU with the tiny model:
encode_batch gives each frame exactly encode_image's prefix state (fp32), tasks started on it
give the reference's outputs, the global-only mode is the model's one-crop encode."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core.encode_request import EncodeRequest, unwrap
from photon_core.engine import EngineOptions
from photon_core.fast import FastEngine
from photon_core.fast.graphed_batch_encoder import GraphedBatchEncoder
from photon_core.models.moondream2 import batched_encode, text
from photon_core.models.moondream2.kv_cache import KVCache
from photon_core.models.moondream2.prefix_prefill import prefill_prefix
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
from photon_core.scheduler.cost_model import image_shape
from photon_core.task import Task

SIZES = ((120, 160), (90, 200), (200, 300), (60, 60), (120, 160))


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


def _kv_equal(a, b):
    """fp32 k/v equal up to the summation order: a batched GEMM may split its reductions
    differently from one frame's (bitwise equal on our CI CPUs, not on the H200 host's
    16-core CPU, where the differences grow through the layers)."""
    if a.shape != b.shape:
        return False
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        print("k/v differ: max abs", (a - b).abs().max().item(), "max |ref|", b.abs().max().item())
        return False
    return True


def _same_enc(a, b):
    return (_kv_equal(a.kv, b.kv) and a.tiling == b.tiling and a.crops == b.crops
            and a.n_crops == b.n_crops and (a.width, a.height) == (b.width, b.height)
            and a.model_id == b.model_id)


def test_reference_encode_batch_equals_encode_image(model, images):
    reqs = [images[0], EncodeRequest(images[1], "global"), images[2],
            EncodeRequest(images[3], "global"), images[4]]
    got = model.encode_batch(reqs)
    assert len(got) == len(reqs)
    for r, g in zip(reqs, got):
        assert _same_enc(model.encode_image(r), g)
        assert g.kv.is_contiguous() and g.kv.shape[2] == 1
    # tilings of different sizes and both modes in one batch
    assert {g.tiling for g in got} == {(1, 2), (1, 1)}
    assert [g.crops for g in got] == ["overlap", "global", "overlap", "global", "overlap"]


def test_encode_batch_passes_encodings_through_and_keeps_order(model, images):
    enc = model.encode_image(images[2])
    got = model.encode_batch([images[0], enc, images[1]])
    assert got[1] is enc
    assert _same_enc(got[0], model.encode_image(images[0]))
    assert _same_enc(got[2], model.encode_image(images[1]))
    assert model.encode_batch([]) == []


def test_batched_prefill_span_form_is_text_decoder(model):
    """prefix_prefill (reference form) per frame == text.decoder into a KVCache, bitwise."""
    t, w = model.config.text, model.weights
    x = torch.randn(3, model.prefix_len, t.dim, generator=torch.Generator().manual_seed(1))
    kv = batched_encode.kv_buffer(model, 3)
    with torch.inference_mode():
        h = prefill_prefix(w, t, x, kv, model.prefix_len)
        for i in range(3):
            cache = KVCache(t.n_layers, t.n_kv_heads, model.prefix_len, t.head_dim,
                            w.device, w.dtype)
            hi = text.decoder(w, t, x[i:i + 1], 0, cache, model.prefix_len)
            assert _kv_equal(cache.data[:, :, 0], kv[:, :, i])
            assert _kv_equal(hi[0], h[i])


def test_batched_prefill_fast_form_is_close(model):
    """The mask-free prefix attention: same math, other summation order."""
    t, w = model.config.text, model.weights
    x = torch.randn(2, model.prefix_len, t.dim, generator=torch.Generator().manual_seed(2))
    ref, fast = batched_encode.kv_buffer(model, 2), batched_encode.kv_buffer(model, 2)
    with torch.inference_mode():
        prefill_prefix(w, t, x, ref, model.prefix_len)
        prefill_prefix(w, t, x, fast, model.prefix_len, fast=True)
    err = (ref - fast).abs().max().item()
    assert 0 < err <= 1e-5 * ref.abs().max().item()        # not the same code, same math
    with pytest.raises(ValueError):
        prefill_prefix(w, t, torch.zeros(1, model.prefix_len + 1, t.dim),
                       batched_encode.kv_buffer(model, 1), model.prefix_len)


def test_batched_encode_bf16_close(images):
    """bf16 on the CPU: the batched SDPA may round differently with other frames beside it
    (measured 1 bf16 ulp in a few k values); close, and bitwise in fp32 (the tests above)."""
    m = build_random_model(tiny_config(fast=True), seed=0, dtype="bf16")
    reqs = [EncodeRequest(images[0], "global"), images[1], images[2]]
    for r, g in zip(reqs, m.encode_batch(reqs)):
        ref = m.encode_image(r)
        err = (ref.kv.float() - g.kv.float()).abs().max().item()
        assert err <= 2e-2 * ref.kv.float().abs().max().item(), err


def test_fast_engine_encode_batch_and_tasks_match_reference(model, images):
    fe = FastEngine(model, max_batch=4)
    reqs = [images[0], EncodeRequest(images[1], "global"), images[2], images[3]]
    got = fe.encode_batch(reqs)
    refs = [model.encode_image(r) for r in reqs]
    for r, g in zip(refs, got):
        assert _same_enc(r, g)
    tasks = [Task("detect", object="person", max_objects=4), Task("point", object="cup"),
             Task("query", question="What is it?", max_tokens=8),
             Task("caption", caption_length="short", max_tokens=8)]
    for r, t, res in zip(refs, tasks, fe.run_batch(list(zip(got, tasks)))):
        ref = model.run(r, t)
        assert (res.output, res.tokens, res.finish_reason) == (ref.output, ref.tokens,
                                                               ref.finish_reason)
    # encode_image honours the crops keyword and the EncodeRequest
    assert _same_enc(fe.encode_image(images[2], crops="global"),
                     model.encode_image(EncodeRequest(images[2], "global")))
    fe.close()


def test_global_crops_is_the_one_crop_encode(model, images):
    """crops="global": one crop, and for an image that fits one crop (tiling (1, 1): its
    local crop is the global view) exactly the overlap encode; elsewhere a different one."""
    small = images[3]                                    # 60 x 60: tiling (1, 1)
    a, b = model.encode_image(small), model.encode_image(small, crops="global")
    assert a.tiling == (1, 1) and a.n_crops == 2 and b.n_crops == 1
    assert torch.equal(a.kv, b.kv)
    big_o, big_g = model.encode_image(images[2]), model.encode_image(images[2], crops="global")
    assert big_o.n_crops == 3 and big_g.n_crops == 1 and big_g.tiling == (1, 1)
    assert not torch.equal(big_o.kv, big_g.kv)


def test_engine_default_crops(images):
    m = build_random_model(tiny_config(fast=True), seed=0)
    fe = FastEngine(m, max_batch=1, options=EngineOptions(crops="global"))
    e = fe.encode_image(images[2])
    assert e.crops == "global" and e.n_crops == 1
    assert fe.encode_image(EncodeRequest(images[2], "overlap")).crops == "overlap"
    assert fe.encode_batch([images[2]])[0].crops == "global"
    m.crops = "global"
    assert m.encode_image(images[2]).crops == "global"
    fe.close()


def test_encode_request_and_options_validation(images):
    with pytest.raises(ValueError, match="crops"):
        EncodeRequest(images[0], "tiles")
    with pytest.raises(ValueError):
        EngineOptions(crops="none")
    with pytest.raises(ValueError):
        EngineOptions(encoder="turbo")
    r = EncodeRequest(images[0], "global")
    assert unwrap(r, None)[1] == "global" and unwrap(r, "overlap")[1] == "overlap"
    assert unwrap(images[0], None, "global")[1] == "global"
    assert image_shape(r) == images[0].shape[:2]       # the scheduler's cost key sees through


def test_fast_forms_close_and_same_outputs(images):
    """EngineOptions(encoder="fast") on the CPU: the mask-free prefix attention (the GELU
    epilogue is CUDA-only); close to the reference encode, same task outputs here."""
    m = build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)
    fe = FastEngine(m, max_batch=2, options=EngineOptions(encoder="fast"))
    assert fe.fast_encode
    for img in images[:3]:
        ref, got = m.encode_image(img), fe.encode_image(img)
        assert (ref.kv - got.kv).abs().max().item() <= 1e-5 * ref.kv.abs().max().item()
        t = Task("detect", object="person", max_objects=4)
        assert m.run(ref, t).output == fe.run(got, t).output
    fe.close()


class _FakeGraphs(GraphedBatchEncoder):
    """The capture policy without CUDA: a 'graph' is a marker, the body runs eagerly."""

    def _capture(self, e):
        self.captured.append(e.layouts)
        return None


def test_batch_graph_policy(model, images):
    enc = _FakeGraphs(model, use_graphs=True, max_batch_graphs=1, max_frames=3)
    enc.captured = []
    a, b, c = images[0], images[1], images[2]
    ref = {id(x): model.encode_image(x) for x in (a, b, c)}
    # first sight of a two-frame layout: frame by frame (single-frame layouts captured)
    out = enc.encode_batch([a, EncodeRequest(b, "global")])
    assert enc.counts["frame_by_frame"] == 1 and enc.n_batch_graphs() == 0
    assert all(len(k) == 1 for k in enc.captured)
    # second sight, other order: the same (canonical) layout, captured, batched
    out2 = enc.encode_batch([EncodeRequest(b, "global"), a])
    assert enc.counts["batched"] == 1 and enc.n_batch_graphs() == 1
    assert _same_enc(out[0], out2[1]) and _same_enc(out[1], out2[0])
    assert _same_enc(out[0], ref[id(a)])
    # the bound: another layout is never captured, encoded frame by frame
    for _ in range(3):
        out3 = enc.encode_batch([a, c])
    assert enc.n_batch_graphs() == 1 and enc.counts["frame_by_frame"] == 4
    assert _same_enc(out3[1], ref[id(c)])
    # more frames than max_frames: chunks
    out4 = enc.encode_batch([a, c, a, c])
    assert [o.width for o in out4] == [a.shape[1], c.shape[1]] * 2


@pytest.mark.skipif(not __import__("photon_core.ops", fromlist=["HAVE_TRITON"]).HAVE_TRITON,
                    reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layernorm_kernel_matches_reference(dtype):
    """ops/add_layernorm.py under the Triton interpreter: the sum bitwise, the norm close."""
    import os

    from photon_core.ops.add_layernorm import add_layernorm, add_layernorm_reference
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    x, t = (torch.randn(5, 7, 72, generator=g).to(dtype) for _ in range(2))
    w, b = torch.randn(72, generator=g).to(dtype), torch.randn(72, generator=g).to(dtype)
    s, h = add_layernorm(x, t, w, b)
    s_ref, h_ref = add_layernorm_reference(x, t, w, b)
    assert torch.equal(s, s_ref)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (h.float() - h_ref.float()).abs().max().item() <= tol * h_ref.float().abs().max()
    with pytest.raises(ValueError):
        add_layernorm(x, t[..., :71].contiguous(), w, b)


def test_vision_fused_forms(model, images, monkeypatch):
    """vision_fused.encoder: the reference's ops on the CPU (bitwise); with the add+norm
    kernel (interpreter) close."""
    import os

    from photon_core.models.moondream2 import vision, vision_fused
    from photon_core.ops.linear_gelu import linear_gelu, linear_gelu_reference
    _, x, _ = model.image_crops(images[0])
    w, v = model.weights, model.config.vision
    with torch.inference_mode():
        ref = vision.encoder(w, v, x)
        assert torch.equal(vision_fused.encoder(w, v, x), ref)
        if os.environ.get("TRITON_INTERPRET") == "1":
            fused = vision_fused.encoder(w, v, x, fuse_norms=True)
            assert (fused - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        cuts = []                 # the graph cut hook: once, after block CUT_AFTER_BLOCK
        assert torch.equal(vision_fused.encoder(w, v, x, cut=lambda: cuts.append(1)), ref)
        assert cuts == ([1] if vision_fused.CUT_AFTER_BLOCK is not None else [])
        monkeypatch.setattr(vision_fused, "CUT_AFTER_BLOCK", None)
        cuts.clear()
        vision_fused.encoder(w, v, x, cut=lambda: cuts.append(1))
        assert cuts == []
    a, wt, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(linear_gelu(a, wt, b), linear_gelu_reference(a, wt, b))
    with pytest.raises(ValueError, match="CUDA"):
        linear_gelu(a, wt, b, fused=True)


def test_prepare_captures_ahead(model, images):
    enc = _FakeGraphs(model, use_graphs=True, max_batch_graphs=2, max_frames=4)
    enc.captured = []
    assert enc.prepare(shapes=((120, 160),), batch_sizes=(1, 2, 4, 8),
                       crops=("overlap", "global")) == 4      # 2 singles + 2 batch (bound)
    assert enc.n_batch_graphs() == 2
    out = enc.encode_batch([images[0], images[4]])             # both 120 x 160: prepared
    assert enc.counts["batched"] == 1 and enc.counts["captures"] == 4
    assert _same_enc(out[0], model.encode_image(images[0]))
    assert GraphedBatchEncoder(model, use_graphs=False).prepare() == 0


def test_uniform_batches_split_over_captured_sizes(model, images):
    enc = _FakeGraphs(model, use_graphs=True, max_batch_graphs=4, max_frames=8)
    enc.captured = []
    enc.prepare(shapes=((120, 160),), batch_sizes=(1, 2, 4))
    n_captured = len(enc.captured)
    a, b = images[0], images[4]                     # both 120 x 160: one layout
    ref = model.encode_image(a)
    out = enc.encode_batch([a, b, a])                # 3 = 2 + 1
    assert enc.counts["split"] == 1 and len(enc.captured) == n_captured
    assert all(_same_enc(o, ref) for o in (out[0], out[2]))
    out = enc.encode_batch([a, b] * 3 + [a])        # 7 = 4 + 2 + 1
    assert enc.counts["split"] == 2 and len(enc.captured) == n_captured
    assert _same_enc(out[6], ref) and _same_enc(out[5], model.encode_image(b))
    assert enc._uniform_split((enc.entries[next(iter(enc.entries))].layouts[0],) * 2) is None


def test_capture_safe_rope_perms_equal_ops_rope_perms():
    from photon_core.models.moondream2.prefix_prefill import _rope_perms_on_device
    from photon_core.ops.rope import rope_perms
    for rot, hd in ((32, 64), (16, 64), (4, 8)):
        assert torch.equal(_rope_perms_on_device(rot, hd, "cpu"), rope_perms(rot, hd))
