"""EngineOptions.pdl (programmatic dependent launch of the fused backend's kernels, ops/pdl.py)
on the CPU: under TRITON_INTERPRET=1 the flag runs the kernels' PDL code shape (the GEMV's
first weight tile loaded before the wait) without the griddepcontrol instructions, which only
exist on CUDA; the results must be the same bits as without the flag. The H200 check (with
the instructions, in CUDA graphs): bench/bench_pdl.py."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and
                                os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests")


def test_pdl_launch_gates_the_instructions_off_cuda():
    from photon_core.engine import EngineOptions
    from photon_core.ops.pdl import pdl_launch

    t = torch.zeros(1)
    assert pdl_launch(False, t) == (False, False, {})
    assert pdl_launch(True, t) == (True, False, {})       # code shape yes, no launch_pdl
    with pytest.raises(ValueError):
        EngineOptions(pdl="yes")
    assert EngineOptions(pdl=True).pdl is True
    assert EngineOptions().pdl == "auto"


def test_auto_pdl_serves_small_passes_where_griddepcontrol_exists():
    """EngineOptions.pdl "auto": off without the griddepcontrol instructions (the CPU here);
    with them, PDL for passes of at most PDL_AUTO_ROWS rows only (FusedBackend.pdl_at), and
    not for Moondream 2's program (the Qwen 3.5 / Gemma 4 programs: their fast tests)."""
    from photon_core.fast.fused_backend import PDL_AUTO_ROWS, FusedBackend
    from photon_core.ops.pdl import gdc_available
    _, st = _state("auto")
    f = st.fused          # Moondream 2: measured slower with PDL at 2 and 4 rows
    assert f.pdl is gdc_available(st.hidden) and f.pdl_rows == 0 and not f.pdl_at(1)
    on = FusedBackend.__new__(FusedBackend)
    on.pdl, on.pdl_rows = True, PDL_AUTO_ROWS
    assert [on.pdl_at(b) for b in (1, PDL_AUTO_ROWS, PDL_AUTO_ROWS + 1)] == [True, True, False]
    on.pdl_rows = None
    assert on.pdl_at(1) and on.pdl_at(16)


@pytest.mark.parametrize("b", [1, 3])
def test_gemv_with_pdl_gives_the_same_bits(b):
    from photon_core.ops import gemv as G

    g = torch.Generator().manual_seed(0)
    n, k = 40, 256
    x = torch.randn(b, k, generator=g)
    w = torch.randn(n, k, generator=g) / 8
    bias = torch.randn(n, generator=g)
    cfgs = [G.GemvConfig(16, 32, 1, 4, 1, True), G.GemvConfig(32, 64, 2, 4, 1, True),
            G.GemvConfig(8, 64, 1, 4, 1, False), G.GemvConfig(16, 32, 4, 4, 1, False),
            G.GemvConfig(16, 256, 1, 4, 1, True)]          # one K step: the peeled one only
    n_run = 0
    for cfg in cfgs:
        for epi in (G.EPI_STORE, G.EPI_QKV_GELU, G.EPI_RESIDUAL):
            if not cfg.fits(b, n, k, epi):
                continue
            y0 = torch.randn(b, n + 5, generator=g)
            y1 = y0.clone()
            G.gemv(x, w, bias, y0, epi, n_split=24, gap=5, cfg=cfg)
            G.gemv(x, w, bias, y1, epi, n_split=24, gap=5, cfg=cfg, pdl=True)
            assert torch.equal(y0, y1), (cfg, epi)
            n_run += 1
    assert n_run >= 6


def _state(pdl: bool):
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds
    from photon_core.fast.static_kv_cache import StaticKVCache
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config

    m = build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)
    cfg = m.config.text
    kv = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, 4, 64, cfg.head_dim, "cpu",
                       torch.float32)
    kv.data.normal_(generator=torch.Generator().manual_seed(3))
    st = ds.StepState(m, 4, kv, EngineOptions(fused="on", pdl=pdl))
    assert st.fused is not None and (pdl == "auto" or st.fused.pdl is pdl)
    st.pos.copy_(torch.tensor([5, 40, 63, 12]))
    st.phase.copy_(torch.tensor([0, 1, 2, 3]))
    st.kind.copy_(torch.tensor([0, 1, 1, 0]))
    st.active.fill_(True)
    st.first.copy_(torch.tensor([True, False, False, True]))
    st.out.copy_(torch.tensor([[7, 3, 0, 0], [1, 100, 0, 0], [1, 900, 0, 0], [1, 5, 20, 30]]))
    st.hidden.normal_(generator=torch.Generator().manual_seed(4))
    return m, st


def test_fused_step_with_pdl_gives_the_same_bits():
    """Two decode steps (every head's pick, then the forward: feedback, decoder, row advance)
    of four rows in different phases, with and without EngineOptions.pdl."""
    from photon_core.fast import decode_step as ds

    res = []
    for pdl in (False, True):
        m, st = _state(pdl)
        for _ in range(2):
            for name in ("lm", "coord", "size"):
                ds.head(name)(st, 4)
            ds.forward(st, 4)
        res.append({"hidden": st.hidden, "out": st.out, "pos": st.pos, "phase": st.phase,
                    "first": st.first, "kv": st.kv.data, "x": st.fused.x})
    for f in res[0]:
        assert torch.equal(res[0][f], res[1][f]), f


def test_norm_edges_take_pdl_launches_at_every_pass(monkeypatch):
    """fused_backend.NORM_PDL: each LayerNorm directly followed by the GEMV that reads its
    output (every layer's, the lm head's) is a norm edge, so both take PDL launches at any
    row count where EngineOptions.pdl gives the pass none (Moondream 2); nothing else does,
    and the steps keep their bits (the PDL code shapes, as above)."""
    from photon_core.fast import decode_step as ds
    from photon_core.fast import fused_backend as fb

    res = []
    for on in (False, True):
        monkeypatch.setattr(fb, "NORM_PDL", on)
        m, st = _state(False)
        f = st.fused
        ops = [*f.program.ops, *(op for _, h in f.program.heads for op in h.ops)]
        norms = [op for op in ops if op.kind == "norm"]
        if on:
            layers = m.config.text.n_layers
            assert len(norms) == layers + 1 and len(f.norm_edges) == 2 * len(norms)
            nxt = {a: c for a, c in zip(ops, ops[1:])}
            assert all(n in f.norm_edges and nxt[n] in f.norm_edges
                       and nxt[n].kind == "linear" for n in norms)
            assert all(f.pdl_at(16, op) is (op in f.norm_edges) for op in ops)
        else:
            assert f.norm_edges == set() and not any(f.pdl_at(1, op) for op in ops)
        for _ in range(2):
            for name in ("lm", "coord", "size"):
                ds.head(name)(st, 4)
            ds.forward(st, 4)
        res.append({"hidden": st.hidden, "out": st.out, "x": st.fused.x, "kv": st.kv.data})
    for k in res[0]:
        assert torch.equal(res[0][k], res[1][k]), k
