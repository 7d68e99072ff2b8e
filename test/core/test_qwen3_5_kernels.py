"""The Qwen 3.5 Triton kernels (decode-step ops and the chunked delta-rule prefill) vs their
torch references, under TRITON_INTERPRET=1 on the CPU (or on a GPU without it): fp32 (tight)
and fp16 (loose), small odd shapes, fresh random inputs per check, and every buffer the kernel
wrappers allocate poisoned with NaN (an element a kernel forgets to write shows up as NaN).
In-place state updates and cache writes are compared too. Then the decoder with use_kernels:
prefill + 16 greedy steps give the reference's tokens."""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from photon_core.ops import causal_conv1d, gqa_attention, mrope, rmsnorm_gated  # noqa: E402
from photon_core.ops import rmsnorm_zero_centred as rzc  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors while a test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


_seed = [0]


def rnd(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random values on every call (never the same stream twice in a session)."""
    _seed[0] += 1
    g = torch.Generator().manual_seed(1000 + _seed[0])
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def close(a, b, dtype):
    assert not torch.isnan(a).any(), "kernel left NaN (unwritten) elements"
    torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,c,k", [(70, 37, 4), (2, 300, 4), (33, 16, 3)])
def test_conv1d_prefill_rows(dtype, t, c, k):
    """The prefill in the row layout (x [T, C] a column slice of a wider GEMM output, as the
    decoder hands it over) = the reference over x^T: output and new state, with a zero start
    and continuing a given state (T = 2 < K-1 = 3 reads the old state's tail into the new),
    the given state untouched."""
    w = rnd(c, k, dtype=dtype)
    wide = rnd(t, c + 9, dtype=dtype)
    x = wide[:, 5:5 + c]
    for state in (None, rnd(1, c, k - 1, dtype=dtype)):
        keep = None if state is None else state.clone()
        ref, ref_state = causal_conv1d.causal_conv1d_prefill(x.T[None], w, state)
        out, new_state = causal_conv1d.causal_conv1d_prefill_triton(x, w, state, block_t=16,
                                                                    block_c=32)
        close(out, ref[0].T, dtype)
        close(new_state, ref_state, dtype)
        assert state is None or torch.equal(state, keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,c,k", [(1, 37, 4), (2, 300, 4), (1, 16, 3)])
def test_conv1d_step(dtype, b, c, k):
    w = rnd(c, k, dtype=dtype)
    s_ref = rnd(b, c, k - 1, dtype=dtype)
    s_tri = s_ref.clone()
    for _ in range(3):                                 # state carried over several steps
        x = rnd(b, c, dtype=dtype)
        ref = causal_conv1d.causal_conv1d_step(x, w, s_ref)
        out = causal_conv1d.causal_conv1d_step_triton(x, w, s_tri, block_c=64)
        close(out, ref, dtype)
        close(s_tri, s_ref, dtype)
    # a strided state (one slot of a bigger buffer) is updated in place, its neighbours not
    big = rnd(3, c, k - 1, dtype=dtype)
    keep = big.clone()
    x = rnd(1, c, dtype=dtype)
    ref_state = big[1:2].clone()
    ref = causal_conv1d.causal_conv1d_step(x, w, ref_state)
    close(causal_conv1d.causal_conv1d_step_triton(x, w, big[1:2]), ref, dtype)
    close(big[1:2], ref_state, dtype)
    assert torch.equal(big[0], keep[0]) and torch.equal(big[2], keep[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 24), (2, 100)])
def test_rmsnorm_zero_centred(dtype, shape):
    d = shape[-1]
    x, delta, w = rnd(*shape, dtype=dtype), rnd(*shape, dtype=dtype), rnd(d, dtype=dtype, scale=0.3)
    close(rzc.rmsnorm_zero_centred_triton(x, w, 1e-6), rzc.rmsnorm_zero_centred(x, w, 1e-6),
          dtype)
    s_ref, y_ref = rzc.add_rmsnorm_zero_centred(x, delta, w, 1e-6)
    s, y = rzc.rmsnorm_zero_centred_triton(x, w, 1e-6, delta=delta)
    close(s, s_ref, dtype)
    close(y, y_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 8), (3, 2, 40), (6, 128)])
def test_rmsnorm_gated(dtype, shape):
    x, z = rnd(*shape, dtype=dtype), rnd(*shape, dtype=dtype)
    w = (1 + rnd(shape[-1], scale=0.3)).to(dtype)
    close(rmsnorm_gated.rmsnorm_gated_triton(x, z, w, 1e-6),
          rmsnorm_gated.rmsnorm_gated(x, z, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_gated_reads_a_column_view_without_copying(dtype):
    """z as the joined in-projection's column view [T, H, Dv] (row stride of the whole GEMM
    output): the same bits as a contiguous z, the kernel reading z in place (no copy)."""
    t, h, d = 5, 3, 40
    joined = rnd(t, 2 * h * d + 7, dtype=dtype)
    z = joined[:, h * d + 3:2 * h * d + 3].reshape(t, h, d)
    x, w = rnd(t, h, d, dtype=dtype), (1 + rnd(d, scale=0.3)).to(dtype)
    want = rmsnorm_gated.rmsnorm_gated_triton(x, z.contiguous(), w, 1e-6)
    got = rmsnorm_gated.rmsnorm_gated_triton(x, z, w, 1e-6)
    rows = rmsnorm_gated._rows_view(z, h * d)           # what the kernel reads: z itself
    assert rows.data_ptr() == z.data_ptr() and rows.stride() == (joined.shape[1], 1)
    assert torch.equal(got, want)
    close(got, rmsnorm_gated.rmsnorm_gated(x, z, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,sections", [(4, 2, 32, (2, 1, 1)), (6, 3, 48, (2, 2, 2)),
                                               (2, 1, 64, (4, 2, 2))])
def test_qk_norm_rope(dtype, hq, hkv, d, sections):
    rot = 2 * sum(sections)                                    # partial rotary 0.25 .. 0.375
    pos = torch.tensor([[37], [41], [29]], device=DEV)          # an image-like (t, h, w) token
    cos, sin = mrope.mrope_cos_sin(pos, rot, 10000.0, sections, dtype)
    qg = rnd(hq, 2 * d, dtype=dtype)                           # query and gate interleaved
    q = qg[:, :d]                                              # strided, as in the decoder
    k = rnd(hkv, d, dtype=dtype)
    wq, wk = rnd(d, dtype=dtype, scale=0.3), rnd(d, dtype=dtype, scale=0.3)
    q_ref = mrope.norm_rope(q[:, None], wq, cos, sin, 1e-6)[:, 0]
    k_ref = mrope.norm_rope(k[:, None], wk, cos, sin, 1e-6)[:, 0]
    cache = torch.full((hkv, 9, d), float("nan"), dtype=dtype, device=DEV)
    q_out, k_out = mrope.qk_norm_rope_triton(q, k, wq, wk, cos[0], sin[0], 1e-6,
                                             k_out=cache[:, 5])
    close(q_out, q_ref, dtype)
    close(cache[:, 5], k_ref, dtype)
    assert k_out.data_ptr() == cache[:, 5].data_ptr()
    assert torch.isnan(cache[:, :5]).all() and torch.isnan(cache[:, 6:]).all()
    _, k_new = mrope.qk_norm_rope_triton(q, k, wq, wk, cos[0], sin[0], 1e-6)
    close(k_new, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,length,splits,block", [
    (4, 2, 32, 1, None, 16), (4, 2, 32, 37, 3, 16), (6, 3, 24, 70, None, 16),
    (8, 2, 64, 100, 1, 32), (2, 2, 16, 50, 7, 16)])
def test_gated_gqa_decode(dtype, hq, hkv, d, length, splits, block):
    cap = length + 5
    k, v = rnd(hkv, cap, d, dtype=dtype), rnd(hkv, cap, d, dtype=dtype)
    k[:, length:] = float("nan")                               # past the end: never read
    v[:, length:] = float("nan")
    q, gate = rnd(hq, d, dtype=dtype), rnd(hq, d, dtype=dtype)
    ref = gqa_attention.gated_gqa_decode(q, k, v, length, gate)
    out = gqa_attention.gated_gqa_decode_triton(q, k, v, length, gate, num_splits=splits,
                                                block_s=block)
    close(out, ref, dtype)
    close(gqa_attention.gated_gqa_decode_triton(q, k, v, length, block_s=block),
          gqa_attention.gated_gqa_decode(q, k, v, length), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gqa_decode_length_on_device(dtype):
    """A device-side length: one launch shape for every length of a 90-position cache (splits
    past the length are empty), each result equal to the reference at that length."""
    hq, hkv, d, cap = 4, 2, 32, 90
    k, v = rnd(hkv, cap, d, dtype=dtype), rnd(hkv, cap, d, dtype=dtype)
    for length in (1, 17, 90):
        q, gate = rnd(hq, d, dtype=dtype), rnd(hq, d, dtype=dtype)
        n = torch.tensor([length], dtype=torch.int32, device=DEV)
        out = gqa_attention.gated_gqa_decode_triton(q, k, v, n, gate, num_splits=6, block_s=16)
        close(out, gqa_attention.gated_gqa_decode(q, k, v, length, gate), dtype)
    with pytest.raises(ValueError, match="one integer"):
        gqa_attention.gated_gqa_decode_triton(q, k, v, torch.tensor([3.0], device=DEV))


def test_gated_gqa_decode_reference_is_the_last_row_of_causal_attention():
    """The decode reference equals the last query row of the prefill attention."""
    hq, hkv, t, d = 4, 2, 9, 16
    q, k, v = rnd(hq, t, d), rnd(hkv, t, d), rnd(hkv, t, d)
    full = gqa_attention.gqa_attention(q, k, v, 0)
    torch.testing.assert_close(gqa_attention.gated_gqa_decode(q[:, -1], k, v, t), full[:, -1])


# -- the decoder with its kernels ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from photon_core.models import qwen3_5

    return qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path_factory.mktemp("q35k"),
                                                          seed=11)), device=DEV)


def test_greedy_decode_with_kernels_matches_reference(tiny, monkeypatch):
    """A 70-token prompt (two delta-rule chunks) prefilled, then 16 greedy steps, once through
    the reference and once with use_kernels: same tokens, close logits and states."""
    from photon_core.models.qwen3_5 import decoder
    from photon_core.models.qwen3_5.state import HybridState

    w, cfg = tiny.weights, tiny.config.text
    ids = torch.randint(10, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(4))
    ids = ids.to(DEV)
    calls = {}                                   # every kernel the flag promises is used
    for name in ("causal_conv1d_step_triton", "gated_delta_step_triton",
                 "gated_delta_chunked_triton", "gated_gqa_decode_triton", "qk_norm_rope_triton",
                 "rmsnorm_gated_triton", "rmsnorm_zero_centred_triton"):
        def spy(*a, _f=getattr(decoder, name), _n=name, **k):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **k)
        monkeypatch.setattr(decoder, name, spy)
    runs = {}
    with torch.inference_mode():
        for use in (False, True):
            st = HybridState.empty(cfg, len(ids) + 17, DEV, torch.float32)
            hidden = decoder.forward(w, cfg, decoder.embed(w, ids),
                                     decoder.text_positions(0, len(ids), DEV), st,
                                     use_kernels=use)
            logs = [decoder.logits(w, hidden[-1])]
            tok, toks = int(logs[0].argmax()), []
            for i in range(16):
                toks.append(tok)
                h = decoder.forward(w, cfg, decoder.embed(w, torch.tensor([tok], device=DEV)),
                                    decoder.text_positions(len(ids) + i, 1, DEV), st,
                                    use_kernels=use)
                logs.append(decoder.logits(w, h[-1]))
                tok = int(logs[-1].argmax())
            runs[use] = (toks, torch.stack(logs), st)
            if not use:
                assert calls == {}
    n_lin, n_full = len(cfg.linear_layers), len(cfg.full_layers)
    assert calls == {"causal_conv1d_step_triton": 16 * n_lin, "gated_delta_step_triton": 16 * n_lin,
                     "gated_delta_chunked_triton": n_lin, "gated_gqa_decode_triton": 16 * n_full,
                     "qk_norm_rope_triton": 16 * n_full, "rmsnorm_gated_triton": 16 * n_lin,
                     "rmsnorm_zero_centred_triton": 16 * (2 * len(cfg.layer_types) + 1)}
    (ref_toks, ref_logits, ref_st), (toks, logits, st) = runs[False], runs[True]
    assert toks == ref_toks
    assert len(set(ref_toks)) > 1                              # not a degenerate constant run
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert st.length == ref_st.length == len(ids) + 16
    for i in cfg.full_layers:
        torch.testing.assert_close(st.k[i], ref_st.k[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(st.v[i], ref_st.v[i], atol=1e-4, rtol=1e-4)
    for i in cfg.linear_layers:
        torch.testing.assert_close(st.conv[i], ref_st.conv[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(st.recurrent[i], ref_st.recurrent[i], atol=1e-4, rtol=1e-4)


def _delta_inputs(t, hk, hv, dk, dv, dtype):
    q, k = rnd(1, t, hk, dk, dtype=dtype), rnd(1, t, hk, dk, dtype=dtype)
    v = rnd(1, t, hv, dv, dtype=dtype)
    g = -torch.nn.functional.softplus(rnd(1, t, hv))           # log decay <= 0
    return q, k, v, g, torch.sigmoid(rnd(1, t, hv)), rnd(1, hv, dk, dv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hk,hv,dk,dv,with_state", [
    (1, 1, 1, 16, 16, False), (63, 2, 4, 16, 8, True), (70, 2, 2, 12, 40, False),
    (130, 1, 2, 32, 16, True)])
@pytest.mark.parametrize("solve,scan", [("trsm", "one"), ("kernel", "one"), ("kernel", "two")])
def test_gated_delta_chunked_triton(dtype, t, hk, hv, dk, dv, with_state, solve, scan,
                                    monkeypatch):
    """solve: the chunks' unit lower-triangular systems by torch's solve or by
    ops/unit_lower_solve.py's kernel (gated_delta_rule.FAST_SOLVE); scan: the loop over chunks
    as one kernel or as the states + outputs kernels (SCAN_TWO_PASS; its outputs pass at 32
    value columns per program where the states pass takes 16)."""
    from photon_core.ops import gated_delta_rule as gdr

    monkeypatch.setattr(gdr, "FAST_SOLVE", solve == "kernel")
    monkeypatch.setattr(gdr, "SCAN_TWO_PASS", scan == "two")
    monkeypatch.setattr(gdr, "SCAN_OUT_BLOCK_V", 32)
    q, k, v, g, beta, s0 = _delta_inputs(t, hk, hv, dk, dv, dtype)
    init = s0 if with_state else None
    keep = s0.clone()
    o_ref, s_ref = gdr.gated_delta_scan(q, k, v, g, beta, init)
    o, s = gdr.gated_delta_chunked_triton(q, k, v, g, beta, init, block_v=16)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    close(o, o_ref, dtype)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(s0, keep)                               # the input state is untouched


def test_kernel_wrappers_reject_bad_shapes():
    """Shapes that do not fit give a ValueError that says so, before any launch."""
    from photon_core.ops import gated_delta_rule as gdr

    with pytest.raises(ValueError, match="state shape"):
        causal_conv1d.causal_conv1d_step_triton(rnd(1, 8), rnd(8, 4), rnd(1, 8, 2))
    with pytest.raises(ValueError, match="weight shape"):
        rzc.rmsnorm_zero_centred_triton(rnd(2, 8), rnd(7))
    with pytest.raises(ValueError, match="delta shape"):
        rzc.rmsnorm_zero_centred_triton(rnd(2, 8), rnd(8), delta=rnd(1, 8))
    with pytest.raises(ValueError, match="do not fit"):
        rmsnorm_gated.rmsnorm_gated_triton(rnd(2, 8), rnd(2, 7), rnd(8))
    with pytest.raises(ValueError, match="do not fit"):
        mrope.qk_norm_rope_triton(rnd(2, 8), rnd(1, 8), rnd(8), rnd(8), rnd(10), rnd(10))
    with pytest.raises(ValueError, match="do not fit"):
        gqa_attention.gated_gqa_decode_triton(rnd(3, 8), rnd(2, 5, 8), rnd(2, 5, 8), 5)
    with pytest.raises(ValueError, match="do not fit"):
        gqa_attention.gated_gqa_decode_triton(rnd(4, 8), rnd(2, 5, 8), rnd(2, 5, 8), 6)
    with pytest.raises(ValueError, match="gate shape"):
        gqa_attention.gated_gqa_decode_triton(rnd(4, 8), rnd(2, 5, 8), rnd(2, 5, 8), 5, rnd(4, 7))
    with pytest.raises(ValueError, match="shapes do not fit"):
        q = rnd(1, 4, 1, 16)
        gdr.gated_delta_chunked_triton(q, q, rnd(1, 4, 2, 16), rnd(1, 4, 2), rnd(1, 4, 2), chunk=48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 8), (1, 3, 12, 40)])
def test_gated_delta_step_with_gates_in_the_kernel(dtype, hk, hv, dk, dv):
    """g and beta computed in the kernel from the raw projections a, b (delta_gates), over a
    few steps from a random state; a spans softplus's linear branch (a + dt_bias > 20)."""
    from photon_core.ops import gated_delta_rule as gdr

    s_ref = rnd(2, hv, dk, dv)
    s_tri = s_ref.clone()
    a_log, dt_bias = rnd(hv, scale=0.5).to(dtype), rnd(hv).to(dtype)
    for step in range(3):
        q, k = rnd(2, hk, dk, dtype=dtype), rnd(2, hk, dk, dtype=dtype)
        v, b = rnd(2, hv, dv, dtype=dtype), rnd(2, hv, dtype=dtype)
        a = rnd(2, hv, dtype=dtype, scale=3.0)
        if step == 0:
            a[0, 0], a[1, -1] = 25.0, -30.0                    # softplus' linear / tiny ends
        g, beta = gdr.delta_gates(a, b, a_log, dt_bias)
        ref = gdr.gated_delta_step(q, k, v, g, beta, s_ref)
        out = gdr.gated_delta_step_triton(q, k, v, a, b, s_tri, block_v=16, a_log=a_log,
                                          dt_bias=dt_bias)
        close(out, ref, dtype)
        torch.testing.assert_close(s_tri, s_ref, **TOL[dtype])
    with pytest.raises(ValueError, match="go together"):
        gdr.gated_delta_step_triton(q, k, v, a, b, s_tri, a_log=a_log)


@pytest.mark.skipif(DEV != "cuda", reason="real-size shapes: GPU only (the interpreter is slow)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_real_sizes_on_gpu(dtype):
    """Qwen 3.5 0.8B/2B-like sizes (16 DeltaNet heads of 128, conv dim 6144, 8 query / 2 k/v
    heads of 256, a 1000-token cache / prefill) compiled for the GPU."""
    from photon_core.ops import gated_delta_rule as gdr

    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else TOL[dtype]
    w, s = rnd(6144, 4, dtype=dtype), rnd(1, 6144, 3, dtype=dtype)
    x, s2 = rnd(1, 6144, dtype=dtype), s.clone()
    torch.testing.assert_close(causal_conv1d.causal_conv1d_step_triton(x, w, s2),
                               causal_conv1d.causal_conv1d_step(x, w, s), **tol)
    x, d, wn = rnd(1, 2048, dtype=dtype), rnd(1, 2048, dtype=dtype), rnd(2048, dtype=dtype)
    for a, b in zip(rzc.rmsnorm_zero_centred_triton(x, wn, 1e-6, delta=d),
                    rzc.add_rmsnorm_zero_centred(x, d, wn, 1e-6)):
        torch.testing.assert_close(a, b, **tol)
    x, z, wg = rnd(16, 128, dtype=dtype), rnd(16, 128, dtype=dtype), rnd(128, dtype=dtype)
    torch.testing.assert_close(rmsnorm_gated.rmsnorm_gated_triton(x, z, wg),
                               rmsnorm_gated.rmsnorm_gated(x, z, wg), **tol)
    pos = torch.tensor([[900], [905], [911]], device=DEV)
    cos, sin = mrope.mrope_cos_sin(pos, 64, 1e7, (11, 11, 10), dtype)
    q, k, wq, wk = rnd(8, 256, dtype=dtype), rnd(2, 256, dtype=dtype), rnd(256, dtype=dtype), \
        rnd(256, dtype=dtype)
    qo, ko = mrope.qk_norm_rope_triton(q, k, wq, wk, cos[0], sin[0])
    torch.testing.assert_close(qo, mrope.norm_rope(q[:, None], wq, cos, sin)[:, 0], **tol)
    torch.testing.assert_close(ko, mrope.norm_rope(k[:, None], wk, cos, sin)[:, 0], **tol)
    kc, vc, gate = rnd(2, 1100, 256, dtype=dtype), rnd(2, 1100, 256, dtype=dtype), \
        rnd(8, 256, dtype=dtype)
    torch.testing.assert_close(gqa_attention.gated_gqa_decode_triton(q, kc, vc, 1000, gate),
                               gqa_attention.gated_gqa_decode(q, kc, vc, 1000, gate), **tol)
    qd, kd, vd, g, beta, s0 = _delta_inputs(1000, 16, 16, 128, 128, dtype)
    o_ref, s_ref = gdr.gated_delta_chunked(qd, kd, vd, g, beta, s0)
    keep = gdr.FAST_SOLVE, gdr.SCAN_TWO_PASS
    try:
        # torch's trsm, the unit_lower_solve kernel; the scan in one pass or two
        for solve, two in ((False, False), (True, False), (True, True)):
            gdr.FAST_SOLVE, gdr.SCAN_TWO_PASS = solve, two
            o, st = gdr.gated_delta_chunked_triton(qd, kd, vd, g, beta, s0)
            torch.testing.assert_close(o, o_ref, **tol)
            torch.testing.assert_close(st, s_ref, atol=1e-3, rtol=1e-3)
    finally:
        gdr.FAST_SOLVE, gdr.SCAN_TWO_PASS = keep
    s_ref, s_tri = s0.clone(), s0.clone()
    o_ref = gdr.gated_delta_step(qd[:, 0], kd[:, 0], vd[:, 0], g[:, 0], beta[:, 0], s_ref)
    o = gdr.gated_delta_step_triton(qd[:, 0], kd[:, 0], vd[:, 0], g[:, 0], beta[:, 0], s_tri)
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)
