"""The fused backend holds the weights it joins once (fused_backend.SHARE_WEIGHTS): in the first
StepState built on a model, each weight a fused GEMV concatenates (rows, K columns, gate / up
row pairs) becomes a view of the joined tensor, with the same values, and its own tensor is
freed; a later StepState on the same weights (whose engines may hold CUDA graphs reading the
old tensors) leaves them as they are. Tiny fp32 checkpoints of the three families, the
fused backend under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and
                                os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests (tiny fp32 models on the CPU)")


def _moondream(tmp_path):
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    return build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)


def _qwen(tmp_path):
    from photon_core.models import qwen3_5
    return qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path, seed=5)))


def _gemma(tmp_path):
    from photon_core.models import gemma4
    return gemma4.load_model(str(gemma4.make_test_model(tmp_path, seed=3)),
                             max_soft_tokens=70)


def _state(model):
    """A FastEngine's StepState with the fused backend (and the weights it was built on)."""
    from photon_core.fast import FastEngine
    fe = FastEngine(model, max_batch=2, kv_capacity=64, fused="on", warmup=False,
                    detok_thread=False)
    fe.close()
    return fe.state, fe.state.w


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("build", [_moondream, _qwen, _gemma])
def test_joined_weights_are_held_once(build, tmp_path, monkeypatch):
    from photon_core.fast import fused_backend
    monkeypatch.setattr(fused_backend, "SHARE_WEIGHTS", True)
    model = build(tmp_path)
    w = model.fast_family().weights
    before = {n: t.clone() for n, t in w.items() if torch.is_tensor(t)}
    old = {n: t for n, t in w.items() if torch.is_tensor(t)}
    st, w = _state(model)
    fd = st.fused
    assert fd is not None and fd.share_weights
    joined = [(op, g) for op, g in fd.fused_gemvs.items() if len(op.weights) > 1]
    assert joined, "no joined GEMV weights in this program"
    for op, g in joined:
        base = g["w"].untyped_storage().data_ptr()
        for name in op.weights:
            t = w[name + ".weight"]
            assert t is not old[name + ".weight"], name
            assert t.untyped_storage().data_ptr() == base, name      # a view of the joined
            assert torch.equal(t, before[name + ".weight"]), name    # the same values
    assert fd.shared_bytes > 0
    del old
    gc.collect()
    tensors = [t for t in w.values() if torch.is_tensor(t)]
    tensors += [g["w"] for g in fd.fused_gemvs.values()]
    # the model's weights and the backend's GEMV weights together: no more bytes than the
    # weights alone plus the biases the backend sums / interleaves (its joined weights are
    # the model's now)
    bias_bytes = sum(g["bias"].numel() * g["bias"].element_size()
                     for g in fd.fused_gemvs.values() if g["bias"] is not None)
    assert _storage_bytes(tensors) <= _storage_bytes(before.values()) + bias_bytes
    # a second state on the same weights shares nothing and changes no entry
    entries = {n: t for n, t in w.items() if torch.is_tensor(t)}
    st2, _ = _state(model)
    assert not st2.fused.share_weights and st2.fused.shared_bytes == 0
    assert all(w[n] is t for n, t in entries.items())


def test_joined_views_layouts():
    from photon_core.weight_layout import adjacent_rows, join_weights, joined_views
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*s, generator=g) for s in ((3, 4), (5, 4), (3, 4)))
    for how, parts in (("rows", [a, b]), ("cols", [a.T.contiguous(), b.T.contiguous()]),
                       ("pairs", [a, c])):
        j = join_weights(parts, how)
        views = joined_views(j, [p.shape for p in parts], how)
        assert all(torch.equal(v, p) for v, p in zip(views, parts)), how
        assert all(v.untyped_storage().data_ptr() == j.untyped_storage().data_ptr()
                   for v in views), how
        if how == "rows":           # the row views span the joined tensor again
            assert torch.equal(adjacent_rows(views), j)
            assert adjacent_rows(views).data_ptr() == j.data_ptr()
            assert adjacent_rows(views[::-1]) is None             # not in storage order
            assert adjacent_rows([views[0], b]) is None           # another storage
    assert adjacent_rows([a, a]) is None                          # the same rows twice


def test_a_new_model_after_a_freed_one_shares_again(tmp_path, monkeypatch):
    """The first-state rule follows the weight tensors themselves, not the weights object's
    id (a new model is often allocated where the freed one was)."""
    from photon_core.fast import fused_backend
    monkeypatch.setattr(fused_backend, "SHARE_WEIGHTS", True)
    for _ in range(3):
        model = _moondream(tmp_path)
        st, _ = _state(model)
        assert st.fused.share_weights and st.fused.shared_bytes > 0
        del model, st
        gc.collect()


@pytest.mark.parametrize("captured_first", [False, True])
def test_gemma_fast_tower_holds_its_joined_weights_once(tmp_path, captured_first):
    """Gemma 4's fast vision tower joins q | k | v and gate | up per layer: after an engine
    was built on the model (its StepState holds only the step program's tensors) the model's
    entries become views of the joined tensors; once a graph may read them by address
    (weight_layout.held: a captured reference encode) the tower keeps copies beside them."""
    from photon_core import weight_layout
    from photon_core.models.gemma4.vision_fast import FastTower
    from photon_core.models.gemma4.weights import vision_layer
    model = _gemma(tmp_path)
    st, w = _state(model)
    names = [vision_layer(j, f"self_attn.{n}_proj.linear.weight")
             for j in range(model.config.vision.n_layers) for n in "qkv"]
    assert names[0] in w and not weight_layout.held([w[n] for n in names])
    if captured_first:
        weight_layout.hold(w)
    old = {n: w[n] for n in names}
    before = {n: t.clone() for n, t in old.items()}
    tower = FastTower(w, model.config.vision)
    for j in range(model.config.vision.n_layers):
        for n in names[3 * j:3 * j + 3]:
            shared = w[n].untyped_storage().data_ptr() == tower.qkv[j].data_ptr()
            assert shared != captured_first, n
            assert (w[n] is old[n]) == captured_first, n
            assert torch.equal(w[n], before[n]), n
