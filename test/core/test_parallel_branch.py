"""fast/parallel_branch.py: the gelu part of Moondream 2's joined [qkv | fc1] GEMV beside the
attention chain (a second stream on the GPU, program order on the CPU) changes no bit of a
decoder pass with the joined GEMV's tiles; on a GPU, graphed steps with the branch give the
same tokens as without it."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import fused_ok, fused_pass  # noqa: E402


def _pass(model, monkeypatch, mode, b=2, same_tiles=True, **options):
    from photon_core.fast import parallel_branch
    monkeypatch.setattr(parallel_branch, "MODE", mode)
    monkeypatch.setattr(parallel_branch, "SAME_TILES", same_tiles)
    return fused_pass(model, 64, monkeypatch, {}, b, **options)


@pytest.mark.parametrize("b", [1, 2])     # (fused_pass: rows at positions 5, 9)
def test_branch_changes_no_bits_cpu(fast_model, monkeypatch, b):
    """With the joined GEMV's tiles (SAME_TILES) the split GEMVs add every output's products
    in the same order: the same bits; with each part's own tiles, the same values to fp32
    rounding."""
    fused_ok("on")
    x0, bufs0, f0 = _pass(fast_model, monkeypatch, "off", b)
    x, _, _ = _pass(fast_model, monkeypatch, "side", b, same_tiles=False)
    assert torch.allclose(x, x0, rtol=1e-4, atol=1e-4)
    layers = fast_model.config.text.n_layers
    assert f0.beside_branches == 0
    x, bufs, f = _pass(fast_model, monkeypatch, "side", b)
    # one run per layer for its GEMV + attention (the attention op is consumed)
    assert f.beside_branches == layers
    assert len(f.lowered) == len(f0.lowered) - layers
    assert torch.equal(x, x0)
    for k in bufs0:
        assert torch.equal(bufs[k], bufs0[k]), k


@pytest.mark.parametrize("deterministic,same_tiles", [(True, False), (False, True),
                                                       (False, False)])
def test_deterministic_mode_keeps_the_joined_tiles(fast_model, monkeypatch, deterministic,
                                                    same_tiles):
    """EngineOptions.deterministic (or SAME_TILES): both split GEMVs take the joined GEMV's
    tiles (gemv.pick at the joined width), so a deterministic engine's bits stay the
    one-stream lowering's; otherwise each part's own pick. (At the tiny model's widths both
    picks are the same tiles on the CPU: the calls' configs are checked, and the bits.)"""
    fused_ok("on")
    from photon_core.fast import parallel_branch
    from photon_core.ops.gemv import EPI_QKV_GELU, pick
    seen = []

    def recording(x, w, bias, y, epi=0, n_split=0, gap=0, cfg=None, **kw):
        seen.append(cfg)
        return gemv(x, w, bias, y, epi, n_split, gap, cfg, **kw)
    gemv = parallel_branch.gemv
    monkeypatch.setattr(parallel_branch, "gemv", recording)
    x0, bufs0, f0 = _pass(fast_model, monkeypatch, "off", 2, deterministic=deterministic)
    assert seen == []                                  # (the joined GEMV: not this module's)
    x, bufs, f = _pass(fast_model, monkeypatch, "side", 2, same_tiles=same_tiles,
                       deterministic=deterministic)
    layers = fast_model.config.text.n_layers
    assert f.deterministic is deterministic and len(seen) == 2 * layers
    joined = f.fused_gemvs[next(op for op in f.program.ops if op.kind == "linear"
                                and op in f.fused_gemvs)]["w"].shape
    want = pick(2, joined[0], joined[1], EPI_QKV_GELU, deterministic) \
        if deterministic or same_tiles else None
    assert all(c == want for c in seen), (seen[:2], want)
    assert torch.equal(x, x0) and all(torch.equal(bufs[k], bufs0[k]) for k in bufs0)


def test_more_rows_than_max_take_the_joined_gemv(fast_model, monkeypatch):
    """A pass of more than MAX_ROWS rows runs the joined GEMV and the attention in order:
    the one-stream bits even with each part's own tiles."""
    fused_ok("on")
    from photon_core.fast import parallel_branch
    x0, bufs0, _ = _pass(fast_model, monkeypatch, "off", 2)
    monkeypatch.setattr(parallel_branch, "MAX_ROWS", 1)
    x, bufs, f = _pass(fast_model, monkeypatch, "side", 2, same_tiles=False)
    assert f.beside_branches == fast_model.config.text.n_layers
    assert torch.equal(x, x0) and all(torch.equal(bufs[k], bufs0[k]) for k in bufs0)


def test_branch_needs_the_pattern():
    """Only a joined [plain | gelu] GEMV followed by ops that leave its gelu part and its
    input alone forks: a residual reading the gelu part, or nothing between, does not."""
    from photon_core.fast.parallel_branch import _conflicts
    from photon_core.program import Op
    att = Op("attention", ("qkv",), ("a",), layer=0)
    res = Op("residual", ("a", "g"), (), ("p", "f"))
    clobber = Op("attention", ("qkv",), ("h",), layer=0)
    assert not _conflicts(att, ("h",), ("g",))
    assert _conflicts(res, ("h",), ("g",))            # reads the gelu part
    assert _conflicts(clobber, ("h",), ("g",))        # writes the GEMV's input


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_branch_graphed_steps_gpu(monkeypatch):
    """Graphed decode steps with the fused step (megakernel off), the split GEMVs on the
    joined GEMV's tiles: streams forked inside the captured graphs at buckets 1 and 2, the
    joined GEMV at bucket 4 (MAX_ROWS): the same tokens as the one-stream lowering (a
    missing fork or join edge lets the residual read a stale fc1 part)."""
    from photon_core.fast import FastEngine, parallel_branch
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
    from photon_core.task import Task

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype="bf16", seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    enc = m.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    tasks = [Task("detect", object="person", max_objects=4),
             Task("point", object="cup", max_objects=4),
             Task("query", question="What is it?", max_tokens=16)]
    monkeypatch.setattr(parallel_branch, "SAME_TILES", True)
    outs = []
    for md in ("off", "side"):
        monkeypatch.setattr(parallel_branch, "MODE", md)
        fe = FastEngine(m, max_batch=4, megakernel="off")
        assert fe.state.fused.beside_branches == (0 if md == "off" else m.config.text.n_layers)
        outs.append([[(r.output, r.tokens, r.finish_reason)
                      for r in fe.run_batch([(enc, t) for t in ts])]
                     for ts in (tasks, tasks[:2])]
                    + [[(r.output, r.tokens) for r in
                        (fe.run(enc, t, ignore_eos=True) for t in tasks[1:])]])
        fe.close()
    assert outs[0] == outs[1]
