"""Qwen 3.5 on the fast path (photon_core.fast.FastEngine over the family's FastFamily view:
step program with Gated DeltaNet + gated attention layers, prefix state with recurrent rows,
text skill protocol): on the tiny random fp32 checkpoint the fast path gives the reference
engine's greedy tokens (and a seeded sampled query's), text, finish reasons and grounding
results for query / caption / detect / point at batch 1 and 2 (the eager backend on the CPU; the fused backend under
TRITON_INTERPRET=1)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from photon_core.fast import FastEngine
from photon_core.models import qwen3_5
from photon_core.task import Task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import fused_ok as _fused_ok  # noqa: E402
from engine_runs import fused_pass, fused_pattern_bits, pdl_changes_no_bits  # noqa: E402
from engine_runs import results_and_text as _fast  # noqa: E402
from engine_runs import same_run as _same  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path_factory.mktemp("q35f"),
                                                          seed=5)))


@pytest.fixture(scope="module")
def encs(model):
    rng = np.random.default_rng(3)
    return [model.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((96, 128), (64, 64))]


KV = 512      # state-cache positions per row (the CPU default, max_context, is slow to attend over)
TASKS = [Task("query", question="What color is the cup?", max_tokens=10),
         Task("caption", caption_length="short", max_tokens=8),
         Task("detect", object="person", max_objects=1),
         Task("point", object="cup", max_objects=1),
         Task("query", question="How many dogs?", max_tokens=3),
         Task("query", question="Color?", temperature=0.8, top_p=0.9, seed=5, max_tokens=8)]


def _reference(model, enc, task):
    r = model.start(enc, task)
    while r.step():
        pass
    return r.result(), r.streamer.text


def test_fast_family_view(model, encs):
    fam = model.fast_family()
    prog = fam.spec.program
    cfg = model.config.text
    assert prog.kv_layers == cfg.full_layers
    assert [(s.kind, s.layer) for s in prog.row_states] == [
        (k, i) for i in cfg.linear_layers for k in ("conv", "recurrent")]
    p = fam.prefix(encs[0])
    st = encs[0].state
    assert p.length == st.length and p.position_offset == st.rope_pos - st.length != 0
    assert all(t.dtype == torch.float32 for s, t in zip(prog.row_states, p.recurrent)
               if s.kind == "recurrent")
    for t in TASKS:
        assert fam.count_prompt_tokens(t) == len(fam.prompt(t, encs[0]))
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    assert [t.dtype for t in fe.kv.recurrent] == [
        torch.float32 if s.kind == "recurrent" else model.dtype for s in prog.row_states]
    with pytest.raises(ValueError, match="different model"):
        fe.start(encs[0].__class__(**{**encs[0].__dict__, "model_id": "other"}), TASKS[0])
    fe.close()
    from photon_core import EngineOptions, load_engine     # FAST_PATH: engine="fast" serves it
    fe = load_engine(model.model_id, engine="fast",
                     options=EngineOptions(max_batch=1, kv_capacity=KV))
    assert isinstance(fe, FastEngine) and fe.max_runs == 1
    fe.close()


@pytest.mark.parametrize("fused", ["off", "on"])
def test_fast_path_matches_reference(model, encs, fused):
    _fused_ok(fused)
    tasks = TASKS if fused == "off" else TASKS[:3]
    fe = FastEngine(model, max_batch=2, kv_capacity=KV, fused=fused)
    assert (fe.state.fused is not None) == (fused == "on")
    if fused == "on":      # decode steps through the rows kernels (fast/hybrid_rows.py)
        assert fe.state.fused.rows_lowering is not None
    refs = {}

    def want(i, k):
        if (i, k) not in refs:
            refs[(i, k)] = _reference(model, encs[i], tasks[k])
        return refs[(i, k)]
    # detect / point answers of the random model are no JSON: counted like the reference's
    before = model.stats["grounding_parse_errors"]
    for i, enc in enumerate(encs if fused == "off" else encs[:1]):        # batch 1
        for k, t in enumerate(tasks):
            got = _fast(fe, [(enc, t)])[0]
            assert _same(got, want(i, k)), (i, t, got, want(i, k))
    for k in range(len(tasks) if fused == "off" else 1):  # batch 2: two frames, two skills
        pairs = [(0, k), (1, (k + 1) % len(tasks))]
        got = _fast(fe, [(encs[i], tasks[j]) for i, j in pairs])
        for g, (i, j) in zip(got, pairs):
            assert _same(g, want(i, j)), (i, tasks[j], g, want(i, j))
    assert model.stats["grounding_parse_errors"] > before
    fe.close()


def test_fused_gated_mlp_changes_no_bits(model, monkeypatch):
    """The SwiGLU MLP's [gate, up] GEMV writes silu(gate) * up in its epilogue (one launch
    instead of two per layer): the same bits as the GEMV + the gated activation kernel."""
    _fused_ok("on")
    (x1, b1, (chained, gated, n1)), (x0, b0, _) = fused_pattern_bits(model, KV, monkeypatch)
    n_layers = model.config.text.num_hidden_layers
    assert (chained, gated) == (0, n_layers) and torch.equal(x1, x0)
    prog = model.fast_family().spec.program
    buf, off, w = prog.segment("m")
    assert torch.equal(b1[buf][:, off:off + w], b0[buf][:, off:off + w])


def test_fused_delta_net_runs_as_one_launch(model, monkeypatch):
    """hybrid_rows.FUSE_DELTA_NET: each Gated DeltaNet layer's conv1d -> delta_rule ->
    gated_norm is one launch per decode step (two fewer per linear-attention layer), the
    decoder pass and both states within fp32 rounding of the three launches."""
    from photon_core.fast import hybrid_rows
    _fused_ok("on")
    outs = []
    for on in (True, False):
        monkeypatch.setattr(hybrid_rows, "FUSE_DELTA_NET", on)
        x, bufs, f = fused_pass(model, KV, monkeypatch, {})
        outs.append((x, f, {k: v.clone() for k, v in f.kv.states.items()}))
    (x1, f1, s1), (x0, f0, s0) = outs
    n_linear = model.config.text.layer_types.count("linear_attention")
    assert n_linear > 0 and (f1.fused_runs, f0.fused_runs) == (n_linear, 0)
    assert len(f0.lowered) - len(f1.lowered) == 2 * n_linear
    torch.testing.assert_close(x1, x0, atol=1e-5, rtol=1e-5)
    assert s1.keys() == s0.keys()
    for key in s1:
        torch.testing.assert_close(s1[key], s0[key], atol=1e-5, rtol=1e-5)


def test_fused_pass_with_pdl_gives_the_same_bits(model, monkeypatch):
    """EngineOptions.pdl: the GEMVs' PDL code shape (first weight tile before the wait) and
    the rows kernels' pdl arguments (the norm, fused DeltaNet, attention kernels) change no
    bit of the pass, the buffers or the row states."""
    from photon_core.fast.fused_backend import PDL_AUTO_ROWS, auto_pdl_rows
    _fused_ok("on")
    pdl_changes_no_bits(model, KV, monkeypatch)
    assert auto_pdl_rows(model.fast_family().spec.program) == PDL_AUTO_ROWS   # pdl "auto"


@pytest.mark.parametrize("conv_kernel,joined", [(False, False), (True, False), (True, True)],
                         ids=["torch-conv", "conv-kernel", "joined-in-proj"])
def test_fused_norms_prefix_pass(model, monkeypatch, conv_kernel, joined):
    """decoder.forward(fused_norms=True) (the fast encode's image-prefix pass: the norms, the
    residual adds and the MLP's gate as Triton kernels, the full-attention layers by SDPA's
    causal kernel; conv-kernel: with FAST_CONV's conv kernel, the default; joined-in-proj:
    the DeltaNet in-projections' weights in consecutive rows of one tensor, as the fused
    backend leaves them, run as one GEMM - JOINED_IN_PROJ) over a 20-token prompt: the hidden
    states and every layer's state within fp32 rounding of the torch pass."""
    from photon_core.models.qwen3_5 import decoder
    from photon_core.models.qwen3_5.state import HybridState
    from photon_core.weight_layout import join_weights, joined_views
    _fused_ok("on")
    monkeypatch.setattr(decoder, "FAST_CONV", conv_kernel)   # causal_conv1d_prefill_triton
    monkeypatch.setattr(decoder, "JOINED_IN_PROJ", True)     # (used where the rows allow)
    t = model.config.text
    x = torch.randn(20, t.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = decoder.text_positions(0, 20, "cpu")
    w = dict(model.weights)
    names = [n[:-len("in_proj_qkv.weight")] for n in w if n.endswith("in_proj_qkv.weight")]
    for p in names:                  # fresh copies, joined (or apart: no stale sharing)
        parts = [w[p + n + ".weight"] for n in decoder.IN_PROJ]
        views = joined_views(join_weights(parts, "rows"), [v.shape for v in parts], "rows")
        for n, v in zip(decoder.IN_PROJ, views):
            w[p + n + ".weight"] = v if joined else v.clone()
    calls = []
    real = decoder.adjacent_rows
    monkeypatch.setattr(decoder, "adjacent_rows",
                        lambda ts: calls.append(real(ts) is not None) or real(ts))
    outs = []
    for fused in (False, True):
        st = HybridState.empty(t, 24, "cpu", model.dtype)
        outs.append((decoder.forward(w, t, x.clone(), pos, st, fused_norms=fused), st))
    assert calls and set(calls) == {joined}
    (h0, s0), (h1, s1) = outs
    torch.testing.assert_close(h1, h0, atol=2e-5, rtol=2e-5)
    for part in ("k", "v", "conv", "recurrent"):
        d1, d0 = getattr(s1, part), getattr(s0, part)
        assert d1.keys() == d0.keys() and d1
        for i in d1:
            torch.testing.assert_close(d1[i], d0[i], atol=2e-5, rtol=2e-5)


def test_long_prompt_and_streaming(model, encs):
    """A question of more than 128 prompt tokens takes the generic eager prefill; streamed
    deltas concatenate to the answer."""
    q = "What color is the cup next to the red car on the busy street? " * 12
    t = Task("query", question=q, max_tokens=6)
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    assert fe.count_prompt_tokens(t) > 128
    ref, text = _reference(model, encs[0], t)
    deltas = []
    got = fe.run(encs[0], t, stream=deltas.append)
    assert (got.output, got.tokens, got.finish_reason) == (ref.output, ref.tokens,
                                                           ref.finish_reason)
    assert "".join(deltas) == got.output["answer"]
    fe.close()


def test_scheduler_drives_the_fast_engine(model, encs):
    """The scheduler (latest frame, EDF, batching) drives FastEngine(Qwen 3.5): the results
    are the reference engine's."""
    from photon_core.scheduler import CostModel, Scheduler, Status

    frame = np.random.default_rng(7).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    fe = FastEngine(model, max_batch=2, kv_capacity=KV)
    outs = []
    s = Scheduler(fe, CostModel(ema=0.0), on_result=outs.append, max_batch=2)
    specs = [("ask", TASKS[0], 60.0), ("where", TASKS[3], 60.0)]
    s.submit_frame("cam", 0.0, frame, specs)
    s.run_until_idle()
    assert len(outs) == 2 and all(o.status is Status.DONE for o in outs)
    enc = model.encode_image(frame)
    for o in outs:
        ref = model.run(enc, dict((n, t) for n, t, _ in specs)[o.task_name])
        assert (o.result.output, o.result.tokens) == (ref.output, ref.tokens)
    fe.close()
