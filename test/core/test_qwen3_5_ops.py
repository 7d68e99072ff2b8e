"""The Qwen 3.5 ops: chunked delta rule == token-by-token scan == repeated one-token steps
(with and without an initial state, GQA-style head sharing, lengths around the chunk size);
conv prefill in pieces == conv steps == one prefill; M-RoPE selects rows as documented."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from photon_core.ops.causal_conv1d import causal_conv1d_prefill, causal_conv1d_step
from photon_core.ops.gated_delta_rule import gated_delta_chunked, gated_delta_scan, gated_delta_step
from photon_core.ops.mrope import mrope_cos_sin
from photon_core.ops.rmsnorm_zero_centred import rmsnorm_zero_centred


def _inputs(t, hk=2, hv=4, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, t, hk, dk, generator=g), torch.randn(1, t, hk, dk, generator=g)
    v = torch.randn(1, t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(1, t, hv, generator=g))        # log decay <= 0
    beta = torch.sigmoid(torch.randn(1, t, hv, generator=g))
    s0 = torch.randn(1, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("t,chunk", [(1, 64), (7, 4), (16, 4), (70, 64), (33, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_scan_equals_steps(t, chunk, with_state):
    q, k, v, g, beta, s0 = _inputs(t)
    init = s0 if with_state else None
    o_scan, s_scan = gated_delta_scan(q, k, v, g, beta, init)
    o_chunk, s_chunk = gated_delta_chunked(q, k, v, g, beta, init, chunk=chunk)
    torch.testing.assert_close(o_chunk, o_scan, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_scan, atol=1e-5, rtol=1e-5)
    state = s0.clone() if with_state else torch.zeros_like(s0)
    for i in range(t):
        o = gated_delta_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state)
        torch.testing.assert_close(o, o_scan[:, i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, s_scan, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,fast_chunk", [(70, 64), (70, 16), (33, 128)])
@pytest.mark.parametrize("with_state", [False, True])
def test_fast_chunked_equals_scan(monkeypatch, t, fast_chunk, with_state):
    """gated_delta_chunked(fast=True), the encode's form: FAST_CHUNK-token chunks, one
    triangular solve for both right-hand sides, TF32 matmuls inside (CUDA only: on the CPU
    fp32 stays exact) - the scan's results; the process's TF32 setting is left as it was."""
    from photon_core.ops import gated_delta_rule as gdr
    monkeypatch.setattr(gdr, "FAST_CHUNK", fast_chunk)
    q, k, v, g, beta, s0 = _inputs(t)
    init = s0 if with_state else None
    o_scan, s_scan = gated_delta_scan(q, k, v, g, beta, init)
    before = torch.backends.cuda.matmul.allow_tf32
    o, st = gated_delta_chunked(q, k, v, g, beta, init, fast=True)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    torch.testing.assert_close(o, o_scan, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, s_scan, atol=1e-5, rtol=1e-5)
    with gdr.tf32_matmuls():
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.parametrize("t,fast_chunk", [(70, 64), (33, 16)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("prep", [False, True], ids=["torch-prep", "prep-kernel"])
def test_fast_chunked_scan_kernel_equals_scan(monkeypatch, t, fast_chunk, with_state, prep):
    """The fast form with its loop over chunks as the Triton scan kernel (FAST_SCAN, the default
    on CUDA; here forced, in the interpreter, fp32): the scan's results, the state passed in
    untouched, for a v laid out as Qwen's decoder hands it over; prep: what feeds the scan
    from FAST_PREP's kernel (the default) (GQA: 2 key heads for 4 value heads)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test")
    from photon_core.ops import gated_delta_rule as gdr
    monkeypatch.setattr(gdr, "SCAN_CHUNK", fast_chunk)
    monkeypatch.setattr(gdr, "FAST_PREP", prep)
    preps = []
    prep_kernel = gdr._fast_prep
    monkeypatch.setattr(gdr, "_fast_prep", lambda *a, **kw: (preps.append(1),
                                                              prep_kernel(*a, **kw))[1])
    monkeypatch.setattr(gdr, "_scan_on_device", lambda v: True)
    calls = []
    kernel = gdr._chunk_scan
    monkeypatch.setattr(gdr, "_chunk_scan", lambda *a, **kw: (calls.append(1),
                                                                kernel(*a, **kw)))
    q, k, v, g, beta, s0 = _inputs(t, hk=2, hv=4, dk=16, dv=16)
    # v as Qwen's decoder hands it over: a dense view of a column-major buffer
    v = v[0].reshape(t, -1).T.contiguous().T.reshape(v.shape)
    assert not v.is_contiguous()
    init = s0.clone() if with_state else None
    o_scan, s_scan = gated_delta_scan(q, k, v, g, beta, init)
    solve = torch.linalg.solve_triangular

    def row_major_solve(*a, **kw):      # the solve's result as a strided view (its column
        r = solve(*a, **kw)             # slices u / w stay strided through the reshape)
        wide = torch.zeros(*r.shape[:-1], 2 * r.shape[-1])
        wide[..., :r.shape[-1]] = r
        return wide[..., :r.shape[-1]]
    monkeypatch.setattr(torch.linalg, "solve_triangular", row_major_solve)
    o, st = gated_delta_chunked(q, k, v, g, beta, init, fast=True)
    assert calls == [1] and preps == ([1] if prep else [])
    torch.testing.assert_close(o, o_scan, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, s_scan, atol=1e-5, rtol=1e-5)
    if with_state:
        assert torch.equal(init, s0)


@pytest.mark.parametrize("fast_gates", [False, True], ids=["torch-gates", "gates-in-prep"])
@pytest.mark.parametrize("scan", [False, True], ids=["torch-loop", "scan-kernel"])
def test_raw_gates_are_delta_gates(monkeypatch, fast_gates, scan):
    """gated_delta_chunked(a, b, raw_gates=(A_log, dt_bias)) = gated_delta_chunked(
    *delta_gates(a, b, A_log, dt_bias)): the reference form bit for bit; the fast form with the
    scan kernel (forced, interpreter) and FAST_GATES makes the gates in its prep kernel (70
    tokens: the second chunk's padded tokens must get g = beta = 0), else delta_gates first."""
    from photon_core.ops import gated_delta_rule as gdr
    q, k, v, _, _, s0 = _inputs(70, hk=2, hv=4, dk=16, dv=16)
    g = torch.Generator().manual_seed(5)
    a_raw, b_raw = torch.randn(1, 70, 4, generator=g), torch.randn(1, 70, 4, generator=g)
    a_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
    gates = gdr.delta_gates(a_raw, b_raw, a_log, dt_bias)
    ref = gated_delta_chunked(q, k, v, *gates, s0, chunk=16)
    raw = gated_delta_chunked(q, k, v, a_raw, b_raw, s0, chunk=16, raw_gates=(a_log, dt_bias))
    assert all(torch.equal(x, y) for x, y in zip(ref, raw))
    if scan:
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreter test")
        monkeypatch.setattr(gdr, "_scan_on_device", lambda v: True)
    monkeypatch.setattr(gdr, "FAST_GATES", fast_gates)
    seen = []
    prep = gdr._fast_prep
    monkeypatch.setattr(gdr, "_fast_prep", lambda *a, **kw: (seen.append(a[-1]),
                                                              prep(*a, **kw))[1])
    fast_ref = gated_delta_chunked(q, k, v, *gates, s0, fast=True)
    fast_raw = gated_delta_chunked(q, k, v, a_raw, b_raw, s0, fast=True,
                                   raw_gates=(a_log, dt_bias))
    for x, y in zip(fast_ref, fast_raw):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    if scan:            # the prep kernel got the raw projections only with FAST_GATES
        assert seen[0] is None and (seen[1] is not None) == fast_gates
    else:
        assert seen == []


def test_delta_rule_writes_value_for_unit_beta_and_no_decay():
    """beta = 1, g = 0, one token: S = k v^T (k unit), so reading with q = k gives v * Dk^-0.5."""
    dk, dv = 4, 3
    k = torch.tensor([[[1.0, 0, 0, 0]]])                         # [B, Hk, Dk]
    v = torch.tensor([[[2.0, -1.0, 0.5]]])
    s = torch.zeros(1, 1, dk, dv)
    o = gated_delta_step(k, k, v, torch.zeros(1, 1), torch.ones(1, 1), s)
    torch.testing.assert_close(o, v * dk ** -0.5)
    torch.testing.assert_close(s[0, 0, 0], v[0, 0])


def test_conv_prefill_in_pieces_equals_steps():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 5, 12, generator=g)
    w = torch.randn(5, 4, generator=g)
    full, state_full = causal_conv1d_prefill(x, w)
    a, st = causal_conv1d_prefill(x[:, :, :5], w)
    b, st = causal_conv1d_prefill(x[:, :, 5:9], w, st)
    outs = [a, b]
    for i in range(9, 12):
        outs.append(causal_conv1d_step(x[:, :, i], w, st)[..., None])
    torch.testing.assert_close(torch.cat(outs, -1), full)
    torch.testing.assert_close(st, state_full)
    # output 0 only sees input 0 (causal, zero history)
    torch.testing.assert_close(full[:, :, 0], F.silu(x[:, :, 0] * w[:, -1]))


def test_mrope_interleaving():
    pos = torch.tensor([[5], [7], [9]])                 # t, h, w rows of one token
    cos, sin = mrope_cos_sin(pos, rot_dim=16, theta=10000.0, sections=(4, 2, 2))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    rows = [0, 1, 2, 0, 1, 2, 0, 0]                      # h at 1, 4; w at 2, 5; rest t
    ang = torch.tensor([float(pos[r, 0]) for r in rows]) * inv
    torch.testing.assert_close(cos[0], torch.cat([ang, ang]).cos())
    torch.testing.assert_close(sin[0], torch.cat([ang, ang]).sin())


def test_zero_centred_rmsnorm():
    x = torch.tensor([[3.0, 4.0]])
    y = rmsnorm_zero_centred(x, torch.tensor([0.0, 1.0]), eps=0.0)
    rms = (12.5) ** 0.5
    torch.testing.assert_close(y, torch.tensor([[3 / rms, 8 / rms]]))


@pytest.mark.parametrize("dk,dv,hk,hv", [(8, 6, 2, 4), (16, 32, 1, 2), (12, 40, 2, 2)])
def test_triton_delta_step_matches_reference(dk, dv, hk, hv):
    """Under TRITON_INTERPRET=1 (CPU) in fp32: several steps from a random state."""
    pytest.importorskip("triton")
    from photon_core.ops.gated_delta_rule import gated_delta_step_triton

    q, k, v, g, beta, s0 = _inputs(5, hk=hk, hv=hv, dk=dk, dv=dv, seed=3)
    s_ref, s_tri = s0.clone(), s0.clone()
    for i in range(5):
        o_ref = gated_delta_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s_ref)
        o_tri = gated_delta_step_triton(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s_tri,
                                        block_v=16)
        torch.testing.assert_close(o_tri, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("shape,budget", [((480, 640), None), ((300, 500), None),
                                          ((64, 64), None), ((480, 640), 200_000)])
def test_device_patches_are_preprocess_bit_for_bit(shape, budget, clip):
    """The engine's encode path on the device - the raw uint8 frame resized by
    pil_resize.ResizePlan (BICUBIC) to resized_size, then image_processor.patches_torch (a
    normalization table lookup, data movement) - gives preprocess's patches exactly, with
    the 0.5 mean / std and CLIP's, without a resize, with an upscale and a downscale (a
    pixel budget)."""
    import numpy as np
    from photon_core.models.qwen3_5.image_processor import (ImageProcessorConfig,
                                                           normalize_table, patches_torch,
                                                           preprocess, resized_size)
    from photon_core.pil_resize import ResizePlan
    kw = {} if budget is None else {"max_pixels": budget}
    cfg = ImageProcessorConfig(image_mean=(0.48145466, 0.4578275, 0.40821073),
                               image_std=(0.26862954, 0.26130258, 0.27577711), **kw) if clip \
        else ImageProcessorConfig(**kw)
    img = np.random.default_rng(shape[0]).integers(0, 256, (*shape, 3), dtype=np.uint8)
    want, grid = preprocess(img, cfg)
    h, w = resized_size(*shape, cfg)
    assert (1, h // cfg.patch_size, w // cfg.patch_size) == grid
    frame = torch.from_numpy(img)
    resized = ResizePlan(*shape, h, w, "cpu", "bicubic")(frame) if (h, w) != shape else frame
    got = patches_torch(resized, torch.from_numpy(normalize_table(cfg)), cfg)
    assert torch.equal(got, torch.from_numpy(want))
