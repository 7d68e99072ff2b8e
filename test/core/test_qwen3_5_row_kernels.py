"""The Qwen 3.5 decode-step kernels over a bucket's rows (the fused backend's lowering of the
hybrid ops) vs the torch row forms the runtime ran before them (ops/gated_delta_net.py,
ops/gated_attention.py, the norms' references), under TRITON_INTERPRET=1 on the CPU (or on a
GPU without it): fp32 tight, fp16 loose; fresh random inputs per check; outputs written into
NaN-poisoned strided views of a wider buffer (an element a kernel forgets shows up as NaN, a
write outside the view breaks the poison around it); rows at different positions; inactive
rows' states and cache slots untouched (bit for bit), and the slots past the bucket too."""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from photon_core.ops import causal_conv1d, gated_delta_rule, gqa_attention, mrope  # noqa: E402
from photon_core.ops import rmsnorm_gated, rmsnorm_zero_centred as rzc, silu_gate  # noqa: E402
from photon_core.ops.delta_net_rows import (delta_net_rows_reference,  # noqa: E402
                                            delta_net_rows_triton)
from photon_core.ops.gated_attention import gated_attention_rows  # noqa: E402
from photon_core.ops.gated_delta_net import conv1d_rows, delta_rule_rows  # noqa: E402
from photon_core.program import AttentionSpec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
DTYPES = [torch.float32, torch.float16]
NAN = float("nan")

_seed = [0]


def rnd(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random values on every call."""
    _seed[0] += 1
    g = torch.Generator().manual_seed(5000 + _seed[0])
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def view(b, width, dtype, pad=3):
    """A NaN-filled [b, width] view into columns pad .. pad+width of a wider buffer, and the
    buffer (to check that nothing around the view was written)."""
    buf = torch.full((b, width + 2 * pad + 1), NAN, dtype=dtype, device=DEV)
    return buf[:, pad:pad + width], buf


def around_untouched(buf, pad, width):
    assert torch.isnan(buf[:, :pad]).all() and torch.isnan(buf[:, pad + width:]).all()


def close(a, b, dtype):
    assert not torch.isnan(a).any(), "kernel left NaN (unwritten) elements"
    torch.testing.assert_close(a, b, **TOL[dtype])


def strided_input(b, width, dtype):
    """Random values in a strided view (the backend's buffers are wider than one segment)."""
    return rnd(b, width + 7, dtype=dtype)[:, 4:4 + width]


ACTIVE = [None, [False, True, True]]       # row 0 inactive, rows after it active


def mask(act, b):
    return None if act is None else torch.tensor(act[:b], device=DEV)


# -- conv1d step -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVE)
@pytest.mark.parametrize("c,k", [(37, 4), (300, 4), (16, 3)])
def test_conv1d_rows(dtype, act, c, k):
    b, rows = 3, 4                                     # slot 3: past the bucket
    w = rnd(c, 1, k, dtype=dtype)                      # the checkpoint's [C, 1, K]
    state = rnd(rows, c, k - 1, dtype=dtype)
    ref_state = state[:b].clone()
    for _ in range(2):                                 # state carried over steps
        before = state.clone()
        x = strided_input(b, c, dtype)
        active = mask(act, b)
        ref = conv1d_rows(x, w[:, 0], ref_state, active)
        out, buf = view(b, c, dtype)
        got = causal_conv1d.causal_conv1d_rows_triton(x, w, state, active, out=out, block_c=64)
        assert got.data_ptr() == out.data_ptr()
        close(out, ref, dtype)
        around_untouched(buf, 3, c)
        close(state[:b], ref_state, dtype)
        assert torch.equal(state[b:], before[b:])
        if act is not None:
            for r in range(b):
                if not act[r]:
                    assert torch.equal(state[r], before[r])


# -- gated delta rule step ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVE)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 24), (1, 1, 32, 32), (2, 2, 12, 40)])
def test_delta_rule_rows(dtype, act, hk, hv, dk, dv):
    b, rows = 3, 4
    dims = (hk, hv, dk, dv)
    a_log, dt_bias = rnd(hv, scale=0.5), rnd(hv, dtype=dtype, scale=0.5)
    state = rnd(rows, hv, dk, dv, scale=0.3)
    ref_state = state[:b].clone()
    for _ in range(2):
        before = state.clone()
        qkv = strided_input(b, 2 * hk * dk + hv * dv, dtype)
        b_in, a_in = strided_input(b, hv, dtype), strided_input(b, hv, dtype)
        active = mask(act, b)
        ref = delta_rule_rows(qkv, b_in, a_in, a_log, dt_bias, ref_state, dims, active)
        out, buf = view(b, hv * dv, dtype)
        gated_delta_rule.gated_delta_rows_triton(qkv, b_in, a_in, a_log, dt_bias, state, dims,
                                                 active, out=out, block_v=16)
        close(out, ref, dtype)
        around_untouched(buf, 3, hv * dv)
        torch.testing.assert_close(state[:b], ref_state, **TOL[torch.float32])
        assert torch.equal(state[b:], before[b:])
        if act is not None:
            for r in range(b):
                if not act[r]:
                    assert torch.equal(state[r], before[r])


# -- the layer's conv + delta rule + gated norm in one launch ----------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVE)
@pytest.mark.parametrize("hk,hv,dk,dv,k", [(2, 4, 16, 24, 4), (1, 1, 32, 32, 4),
                                           (2, 2, 12, 40, 3)])
def test_delta_net_rows(dtype, act, hk, hv, dk, dv, k):
    """One launch = the three ops' references in sequence (conv + SiLU, delta rule, gated
    norm), both states carried over two steps, inactive rows' and other slots' states left
    alone, nothing outside the output view written; and the three kernels it replaces."""
    b, rows = 3, 4
    dims = (hk, hv, dk, dv)
    c = 2 * hk * dk + hv * dv
    w = rnd(c, 1, k, dtype=dtype)
    a_log, dt_bias = rnd(hv, scale=0.5), rnd(hv, dtype=dtype, scale=0.5)
    nw = rnd(dv, dtype=dtype, scale=0.5)
    conv, state = rnd(rows, c, k - 1, dtype=dtype), rnd(rows, hv, dk, dv, scale=0.3)
    ref_conv, ref_state = conv[:b].clone(), state[:b].clone()
    three_conv, three_state = conv.clone(), state.clone()
    for _ in range(2):
        before_conv, before = conv.clone(), state.clone()
        x, z = strided_input(b, c, dtype), strided_input(b, hv * dv, dtype)
        b_in, a_in = strided_input(b, hv, dtype), strided_input(b, hv, dtype)
        active = mask(act, b)
        ref = delta_net_rows_reference(x, z, b_in, a_in, w[:, 0], ref_conv, a_log, dt_bias, nw,
                                       ref_state, dims, 1e-6, active)
        out, buf = view(b, hv * dv, dtype)
        got = delta_net_rows_triton(x, z, b_in, a_in, w, conv, a_log, dt_bias, nw, state, dims,
                                    1e-6, active, out=out)
        assert got.data_ptr() == out.data_ptr()
        # the torch conv sums in fp16 where the kernels sum in fp32, and the gated norm
        # divides by the read-out's rms: fp16 outputs within a few of its ulps (the three
        # kernels below give the kernel's own roundings)
        torch.testing.assert_close(out, ref, **(TOL[dtype] if dtype == torch.float32 else
                                                dict(atol=2e-2, rtol=2e-2)))
        around_untouched(buf, 3, hv * dv)
        close(conv[:b], ref_conv, dtype)
        torch.testing.assert_close(state[:b], ref_state, **TOL[dtype])
        assert torch.equal(state[b:], before[b:]) and torch.equal(conv[b:], before_conv[b:])
        if act is not None:
            for r in range(b):
                if not act[r]:
                    assert torch.equal(state[r], before[r]) and torch.equal(conv[r],
                                                                             before_conv[r])
        # the three launches it replaces, on their own copies of the states
        cc = causal_conv1d.causal_conv1d_rows_triton(x, w, three_conv, active)
        o = gated_delta_rule.gated_delta_rows_triton(cc, b_in, a_in, a_log, dt_bias,
                                                     three_state, dims, active)
        three = torch.empty_like(o)
        rmsnorm_gated.rmsnorm_gated_rows_triton(o, z, nw, three)
        close(out, three, dtype)
        assert torch.equal(conv, three_conv)
        torch.testing.assert_close(state, three_state, **TOL[torch.float32])


def test_delta_net_rows_rejects_bad_shapes():
    dims = (2, 4, 16, 24)
    c = 2 * 2 * 16 + 4 * 24
    x, z = torch.zeros(2, c), torch.zeros(2, 4 * 24)
    bi, w, cs = torch.zeros(2, 4), torch.zeros(c, 4), torch.zeros(2, c, 3)
    st, hv1, nw = torch.zeros(2, 4, 16, 24), torch.zeros(4), torch.zeros(24)
    with pytest.raises(ValueError, match="do not fit"):
        delta_net_rows_triton(x[:, 1:], z, bi, bi, w, cs, hv1, hv1, nw, st, dims, 1e-6)
    with pytest.raises(ValueError, match="conv state"):
        delta_net_rows_triton(x, z, bi, bi, w, cs[:, :, :2], hv1, hv1, nw, st, dims, 1e-6)
    with pytest.raises(ValueError, match="fp32"):
        delta_net_rows_triton(x, z, bi, bi, w, cs, hv1, hv1, nw, st.half(), dims, 1e-6)
    with pytest.raises(ValueError, match="bool"):
        delta_net_rows_triton(x, z, bi, bi, w, cs, hv1, hv1, nw, st, dims, 1e-6,
                              active=torch.ones(2))


# -- gated attention: q/k norm + M-RoPE + cache write, split attention with the gate ------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVE)
@pytest.mark.parametrize("hq,hkv,d,sections,block", [(4, 2, 32, (2, 1, 1), 16),
                                                     (6, 3, 24, (2, 2, 2), 16),
                                                     (2, 1, 64, (4, 2, 2), 32)])
def test_gated_attention_rows(dtype, act, hq, hkv, d, sections, block):
    b, rows, cap, attn_len = 3, 4, 80, 72
    spec = AttentionSpec(hq, hkv, d, 2 * sum(sections), 10000.0, sections)
    qn, kn = rnd(d, dtype=dtype, scale=0.3), rnd(d, dtype=dtype, scale=0.3)
    cache = rnd(2, rows, hkv, cap, d, dtype=dtype)
    cos, sin = mrope.rope_table(cap + 1, spec.rot_dim, spec.theta, sections, dtype, DEV)
    scratch = gqa_attention.RowsAttentionScratch(rows, hq, d, attn_len, DEV, block_s=block,
                                                 programs=3 * hq)
    assert scratch.n_splits > 1
    scratch.m.fill_(NAN), scratch.l.fill_(NAN), scratch.acc.fill_(NAN)
    # rows at different positions: one at position 0, one past attn_len, one at the capacity
    for pos_l, off_l in (([0, 13, 40], [0, -5, -20]), ([71, 75, cap], [0, -30, -1])):
        pos = torch.tensor(pos_l, device=DEV)
        off = torch.tensor(off_l, device=DEV)
        active = mask(act, b)
        qg = strided_input(b, hq * 2 * d, dtype)
        k, v = strided_input(b, hkv * d, dtype), strided_input(b, hkv * d, dtype)
        ref_cache = cache.clone()
        ref = gated_attention_rows(qg, k, v, qn, kn, ref_cache[0], ref_cache[1],
                                   torch.arange(b, device=DEV), pos, pos + off, attn_len, spec)
        before = cache.clone()
        q_out = torch.full((b, hq, d), NAN, dtype=dtype, device=DEV)
        qgh = qg.unflatten(1, (hq, 2 * d))
        mrope.qk_norm_rope_rows_triton(qgh[..., :d], k.unflatten(1, (hkv, d)),
                                       v.unflatten(1, (hkv, d)), qn, kn, cache[0], cache[1],
                                       pos, off, cos, sin, 1e-6, active, q_out=q_out)
        out, buf = view(b, hq * d, dtype)
        gqa_attention.gated_gqa_decode_rows_triton(q_out, cache[0], cache[1], pos, attn_len,
                                                   qgh[..., d:], out=out.unflatten(1, (hq, d)),
                                                   scratch=scratch)
        around_untouched(buf, 3, hq * d)
        assert not torch.isnan(out).any()
        live = [r for r in range(b) if act is None or act[r]]
        slot = pos.clamp(max=cap - 1)
        for r in range(b):
            if r in live:       # the reference's output and its k/v write at the row's slot
                close(out[r], ref[r], dtype)
                close(cache[:, r], ref_cache[:, r], dtype)
            else:               # an inactive row's cache is untouched (bit for bit)
                assert torch.equal(cache[:, r], before[:, r])
                other = torch.arange(cap, device=DEV) != slot[r]
                assert torch.equal(ref_cache[:, r, :, other], before[:, r, :, other])
        assert torch.equal(cache[:, b:], before[:, b:])


def test_rope_table_is_mrope_of_text_positions():
    sections = (2, 1, 1)
    cos, sin = mrope.rope_table(50, 8, 10000.0, sections)
    p = torch.tensor([0, 7, 49])
    c2, s2 = mrope.mrope_cos_sin(p[None].expand(3, 3), 8, 10000.0, sections)
    assert torch.equal(cos[p], c2) and torch.equal(sin[p], s2)


# -- norms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("d", [64, 100])
def test_rmsnorm_zero_centred_rows(dtype, with_delta, d):
    b = 3
    x_buf = rnd(b, d + 5)                              # the fp32 residual stream, strided
    x = x_buf[:, 2:2 + d]
    w = rnd(d, dtype=dtype, scale=0.3)
    delta = rnd(b, d) if with_delta else None
    if with_delta:
        want_x, want = rzc.add_rmsnorm_zero_centred(x.clone(), delta, w, 1e-6)
    else:
        want_x, want = x.clone(), rzc.rmsnorm_zero_centred(x, w, 1e-6)
    out, buf = view(b, d, dtype)
    rest = x_buf.clone()
    rzc.rmsnorm_zero_centred_rows_triton(x, w, out, 1e-6, delta=delta)
    close(out, want.to(dtype), dtype)
    around_untouched(buf, 3, d)
    torch.testing.assert_close(x, want_x, **TOL[torch.float32])
    assert torch.equal(x_buf[:, :2], rest[:, :2]) and torch.equal(x_buf[:, 2 + d:],
                                                                  rest[:, 2 + d:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,d", [(4, 24), (2, 100), (1, 64)])
def test_rmsnorm_gated_rows(dtype, h, d):
    b = 3
    o, z = strided_input(b, h * d, dtype), strided_input(b, h * d, dtype)
    w = rnd(d, dtype=dtype, scale=0.5)
    want = rmsnorm_gated.rmsnorm_gated(o.reshape(b, h, d), z.reshape(b, h, d), w, 1e-6)
    out, buf = view(b, h * d, dtype)
    rmsnorm_gated.rmsnorm_gated_rows_triton(o, z, w, out, 1e-6)
    close(out, want.reshape(b, h * d), dtype)
    around_untouched(buf, 3, h * d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,n", [(3, 96), (1, 1000), (17, 40)])
def test_silu_gate(dtype, b, n):
    g, u = strided_input(b, n, dtype), strided_input(b, n, dtype)
    out, buf = view(b, n, dtype)
    silu_gate.silu_gate_triton(g, u, out=out, block=256)
    close(out, silu_gate.silu_gate(g.float(), u.float()).to(dtype), dtype)
    around_untouched(buf, 3, n)


def test_row_wrappers_reject_bad_shapes():
    c, k = 16, 4
    x = rnd(2, c)
    with pytest.raises(ValueError, match="state shape"):
        causal_conv1d.causal_conv1d_rows_triton(x, rnd(c, k), rnd(1, c, k - 1))
    with pytest.raises(ValueError, match="active"):
        causal_conv1d.causal_conv1d_rows_triton(x, rnd(c, k), rnd(2, c, k - 1),
                                                torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="fp32"):
        gated_delta_rule.gated_delta_rows_triton(rnd(2, 2 * 8 + 8), rnd(2, 1), rnd(2, 1),
                                                 rnd(1), rnd(1), rnd(2, 1, 8, 8).half(),
                                                 (1, 1, 8, 8))
    q = rnd(2, 2, 16)
    with pytest.raises(ValueError, match="do not fit"):
        gqa_attention.gated_gqa_decode_rows_triton(q, rnd(2, 1, 8, 16), rnd(2, 1, 8, 16),
                                                   torch.zeros(2, dtype=torch.long,
                                                               device=DEV), 9, q)
    with pytest.raises(ValueError, match="do not fit"):
        rmsnorm_gated.rmsnorm_gated_rows_triton(rnd(2, 10), rnd(2, 10), rnd(4), rnd(2, 10))


# -- wired into the fused backend: one decode step vs the eager backend -------------------------
def test_fused_backend_step_matches_eager_and_keeps_inactive_rows(tmp_path):
    """One decode step of the tiny Qwen 3.5 program over 3 rows at different positions and
    rotary offsets, row 1 inactive: the fused backend (rows kernels) gives the eager backend's
    hidden states and row states for the active rows; the inactive row's hidden, position,
    conv / recurrent states and k/v cache are untouched, bit for bit."""
    pytest.importorskip("transformers")
    from photon_core.engine import EngineOptions
    from photon_core.fast.decode_step import StepState
    from photon_core.fast.static_kv_cache import StaticKVCache
    from photon_core.models import qwen3_5

    model = qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path, seed=3)), device=DEV)
    fam = model.fast_family()
    prog = fam.spec.program
    rows, cap = 3, 64
    states = {}
    for fused in ("on", "off"):
        kv = StaticKVCache.for_program(prog, rows, cap, DEV, model.dtype)
        g = torch.Generator().manual_seed(7)       # the same random caches for both
        kv.data.copy_(torch.randn(kv.data.shape, generator=g) * 0.5)
        for t in kv.recurrent:
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        st = StepState(fam, rows, kv, EngineOptions(fused=fused))
        assert (st.fused is not None and st.fused.rows_lowering is not None) == (fused == "on")
        st.out[:, 0] = torch.tensor([5, 17, 200])
        st.pos.copy_(torch.tensor([7, 20, 63]))
        st.pos_offset.copy_(torch.tensor([0, -4, -30]))
        st.active.copy_(torch.tensor([True, False, True]))
        st.hidden.copy_(torch.randn(st.hidden.shape, generator=g))
        before = (st.hidden.clone(), kv.data.clone(), [t.clone() for t in kv.recurrent])
        st.backend.forward(st, rows, cap)
        states[fused] = (st, kv, before)
    (sf, kvf, (h0, data0, rec0)), (se, kve, _) = states["on"], states["off"]
    tol = dict(atol=1e-4, rtol=1e-4)
    for r in (0, 2):
        torch.testing.assert_close(sf.hidden[r], se.hidden[r], **tol)
        for a, b in zip(kvf.recurrent, kve.recurrent):
            torch.testing.assert_close(a[r], b[r], **tol)
        torch.testing.assert_close(kvf.data[:, :, r], kve.data[:, :, r], **tol)
    assert sf.pos.tolist() == se.pos.tolist() == [8, 20, 64]
    assert torch.equal(sf.hidden[1], h0[1]) and torch.equal(kvf.data[:, :, 1], data0[:, :, 1])
    assert all(torch.equal(a[1], b[1]) for a, b in zip(kvf.recurrent, rec0))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(kvf.recurrent, rec0))
