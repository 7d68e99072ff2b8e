"""Ops of the Gemma 4 decoder: the sliding-window attention mask against its definition,
the decode op against the block reference, its Triton kernel against the reference (fp32 and
fp16 under TRITON_INTERPRET=1), RMSNorm / proportional RoPE against their formulas."""
from __future__ import annotations

import math
import os

import pytest
import torch

from photon_core.ops.rmsnorm_scaled import rmsnorm_scaled
from photon_core.ops.rotary_half import apply_rotary_half, cos_sin, inv_freq
from photon_core.ops.sliding_window_attention import (attention_mask, sliding_window_decode,
                                                      window_attention)


def test_mask_is_the_window_definition():
    q_pos = torch.arange(3, 20)
    m = attention_mask(q_pos, 20, window=5)
    for a, p in enumerate(q_pos.tolist()):
        for j in range(20):
            assert bool(m[a, j]) == (p - 5 < j <= p)
    full = attention_mask(q_pos, 20, window=None)
    assert torch.equal(full, torch.arange(20)[None] <= q_pos[:, None])


def test_mask_blocks_see_each_other_within_the_window():
    blocks = torch.tensor([-1, 0, 0, 0, -1, -1])
    m = attention_mask(torch.arange(6), 6, window=None, blocks=blocks)
    assert m[1, 3] and m[2, 3] and not m[0, 1] and not m[4, 5]
    m = attention_mask(torch.arange(6), 6, window=2, blocks=blocks)
    # as transformers' sliding_window_overlay: the window bounds the past only
    assert m[1, 3] and m[3, 2] and not m[3, 1]


@pytest.mark.parametrize("window", [None, 4, 64])
def test_decode_matches_block_reference(window):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, cap, pos = 8, 2, 16, 40, 29
    q = torch.randn(hq, d, generator=g)
    k, v = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    ref = window_attention(q[:, None], k[:, :pos + 1], v[:, :pos + 1], torch.tensor([pos]),
                           window, 1.0)[:, 0]
    torch.testing.assert_close(sliding_window_decode(q, k, v, pos, window, 1.0), ref)
    # positions after pos (garbage in the cache) and before the window are never read
    k2, v2 = k.clone(), v.clone()
    k2[:, pos + 1:] = 1e4
    if window:
        v2[:, :max(0, pos - window + 1)] = float("nan")
    torch.testing.assert_close(sliding_window_decode(q, k2, v2, pos, window, 1.0), ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("window,pos,d", [(None, 70, 32), (8, 70, 32), (512, 100, 24), (8, 3, 16)])
def test_triton_decode_kernel(dtype, tol, window, pos, d):
    pytest.importorskip("triton")
    from photon_core.ops.sliding_window_attention import sliding_window_decode_triton
    g = torch.Generator().manual_seed(1)
    hq, hkv, cap = 4, 2, 128
    q = torch.randn(hq, d, generator=g).to(dtype)
    k = torch.randn(hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(hkv, cap, d, generator=g).to(dtype)
    ref = sliding_window_decode(q.float(), k.float(), v.float(), pos, window, 1.0)
    out = sliding_window_decode_triton(q, k, v, pos, window, 1.0, block_n=16)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_rmsnorm_scaled_formula():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, dtype=torch.float64, generator=g)
    w = torch.randn(10, dtype=torch.float64, generator=g)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rmsnorm_scaled(x, w, 1e-6), y)
    torch.testing.assert_close(rmsnorm_scaled(x, None, 1e-6) * w, y)


def test_proportional_rope_turns_only_its_share():
    f = inv_freq(32, 1e6, rotary_fraction=0.25)
    assert f.shape == (16,) and (f[:4] > 0).all() and (f[4:] == 0).all()
    assert math.isclose(float(f[1]), 1e6 ** (-2 / 32), rel_tol=1e-6)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(3))
    cos, sin = cos_sin(torch.arange(5), f, x.dtype)
    y = apply_rotary_half(x, cos, sin)
    still = [i for i in range(32) if i % 16 >= 4]
    torch.testing.assert_close(y[..., still], x[..., still])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_triton_rmsnorm_kernel(dtype, tol, with_weight):
    pytest.importorskip("triton")
    from photon_core.ops.rmsnorm_scaled import rmsnorm_scaled_triton
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(2, 5, 48, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(48, generator=g)).to(dtype) if with_weight else None
    ref = rmsnorm_scaled(x.float(), None if w is None else w.float(), 1e-6)
    out = rmsnorm_scaled_triton(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


# -- Triton kernels of the elementwise ops (TRITON_INTERPRET=1 on the CPU) --------------------
def _interpreted():
    pytest.importorskip("triton")
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_gelu_tanh_gate_kernel(dtype, tol):
    _interpreted()
    from photon_core.ops.gelu_tanh_gate import gelu_tanh_gate, gelu_tanh_gate_triton
    g = torch.Generator().manual_seed(6)
    buf = (4 * torch.randn(3, 2 * 40 + 5, generator=g)).to(dtype)   # segments of one buffer
    gate, up = buf[:, :40], buf[:, 45:85]
    gate[0, :3] = torch.tensor([-30.0, 30.0, 0.0], dtype=dtype)     # saturated tanh, zero
    ref = gelu_tanh_gate(gate.float(), up.float())
    out = gelu_tanh_gate_triton(gate, up, block=16)                  # several column blocks
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    gelu_tanh_gate_triton(gate, up, out=gate)                        # in place into the gate
    torch.testing.assert_close(gate.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cap", [30.0, None])
def test_triton_logit_softcap_kernel(cap):
    _interpreted()
    from photon_core.ops.logit_softcap import logit_softcap, logit_softcap_triton
    g = torch.Generator().manual_seed(7)
    x = 50 * torch.randn(2, 300, generator=g)
    x[0, 0], x[1, 1] = 1e6, -1e6                                     # the cap's limits
    ref = logit_softcap(x, cap)
    out = logit_softcap_triton(x.clone(), cap, block=128)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if cap is not None:
        assert out.abs().max() <= cap and not torch.equal(out, x)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("fraction,norm,with_weight", [(1.0, True, True), (0.25, True, False),
                                                        (1.0, False, False)])
def test_triton_norm_rotary_kernel(dtype, tol, fraction, norm, with_weight):
    """Per-head RMSNorm + rotate-half at each row's own position = rmsnorm_scaled then
    apply_rotary_half (the decoder's q/k path), on a strided segment of a buffer."""
    _interpreted()
    from photon_core.ops.rotary_half import norm_rotary_triton
    g = torch.Generator().manual_seed(8)
    rows, heads, d = 3, 2, 16
    buf = (2 * torch.randn(rows, heads * d + 7, generator=g)).to(dtype)
    x = buf[:, 7:]
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if with_weight else None
    pos = torch.tensor([5, 0, 31])
    cos_t, sin_t = cos_sin(torch.arange(40), inv_freq(d, 1e4, fraction), torch.float32)
    xf = x.float().view(rows, heads, d)
    y = rmsnorm_scaled(xf, None if w is None else w.float(), 1e-6) if norm else xf
    ref = apply_rotary_half(y, cos_t[pos], sin_t[pos]).reshape(rows, heads * d)
    out = norm_rotary_triton(x, w, cos_t.to(dtype), sin_t.to(dtype), pos, d, 1e-6, norm=norm)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # scale-free norm without rotation (Gemma's v)
    out = norm_rotary_triton(x, None, None, None, None, d, 1e-6)
    torch.testing.assert_close(out.float(), rmsnorm_scaled(xf, None, 1e-6).reshape(rows, -1),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_triton_norm_axial_rotary_kernel(dtype, tol):
    """halves=2 (Gemma 4's vision q / k): per-head RMSNorm, then each half of a head rotated
    by its own angles = rmsnorm_scaled then axial_rotary, rows read from a q | k | v slice."""
    _interpreted()
    from photon_core.ops.rotary_half import axial_rotary, norm_rotary_triton
    g = torch.Generator().manual_seed(10)
    n, heads, d = 5, 3, 16
    buf = (2 * torch.randn(n, 3 * heads * d, generator=g)).to(dtype)
    x = buf[:, heads * d:2 * heads * d]                      # k of a fused q | k | v GEMM
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    f = inv_freq(d // 2, 100.0)
    cx, sx = cos_sin(torch.tensor([0, 1, 2, 0, 1]), f, torch.float32)
    cy, sy = cos_sin(torch.tensor([0, 0, 0, 1, 1]), f, torch.float32)
    y = rmsnorm_scaled(x.float().view(n, heads, d), w.float(), 1e-6)
    ref = axial_rotary(y, cx, sx, cy, sy).reshape(n, heads * d)
    cos, sin = (torch.cat(p, -1).to(dtype) for p in ((cx, cy), (sx, sy)))
    out = norm_rotary_triton(x, w, cos, sin, torch.arange(n), d, 1e-6, halves=2)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    whole = norm_rotary_triton(x, w, cos, sin, torch.arange(n), d, 1e-6)   # one block per head
    assert not torch.allclose(whole.float(), ref, atol=0.1)


def test_triton_rotary_half_kernel():
    _interpreted()
    from photon_core.ops.rotary_half import rotary_half_triton
    x = torch.randn(6, 3, 32, generator=torch.Generator().manual_seed(9))
    cos, sin = cos_sin(torch.arange(10, 16), inv_freq(32, 1e6, 0.25), x.dtype)
    torch.testing.assert_close(rotary_half_triton(x, cos, sin), apply_rotary_half(x, cos, sin),
                               atol=1e-6, rtol=1e-6)


# -- the state cache's forms: rows at their own positions, ring or masked window --------------
def _ring_from_full(k_full, pos, slots):
    """A ring of `slots` holding positions max(0, pos-slots+1)..pos of a full-length cache."""
    ring = torch.zeros(k_full.shape[0], slots, k_full.shape[2])
    for p in range(max(0, pos - slots + 1), pos + 1):
        ring[:, p % slots] = k_full[:, p]
    return ring


@pytest.mark.parametrize("pos", [3, 8, 29])
def test_rows_decode_ring_and_masked_window_equal_the_window_reference(pos):
    from photon_core.ops.sliding_window_attention import rows_decode_reference
    g = torch.Generator().manual_seed(10)
    hq, hkv, d, cap, W = 4, 2, 16, 40, 8
    q = torch.randn(hq, d, generator=g)
    k, v = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    ref = sliding_window_decode(q, k, v, pos, W, 1.0)
    rows, p = torch.tensor([1]), torch.tensor([pos])
    full = torch.stack([torch.zeros_like(k), k]), torch.stack([torch.zeros_like(v), v])
    masked = rows_decode_reference(q[None], *full, rows, p, W, False, 1.0, attn_len=cap)
    ring_k = torch.stack([torch.zeros(hkv, W, d), _ring_from_full(k, pos, W)])
    ring_v = torch.stack([torch.zeros(hkv, W, d), _ring_from_full(v, pos, W)])
    ring = rows_decode_reference(q[None], ring_k, ring_v, rows, p, W, True, 1.0)
    torch.testing.assert_close(masked[0], ref)
    torch.testing.assert_close(ring[0], ref)
    glob = rows_decode_reference(q[None], *full, rows, p, None, False, 1.0, attn_len=cap)
    torch.testing.assert_close(glob[0], sliding_window_decode(q, k, v, pos, None, 1.0))


@pytest.mark.parametrize("start,T", [(0, 5), (3, 12), (20, 6)])
def test_prefill_on_a_ring_equals_the_full_length_window(start, T):
    """A prompt chunk prefilled into a ring (the keys before it from the ring) attends like
    the block reference over a full-length cache, and leaves the ring holding the last W."""
    from photon_core.ops.sliding_window_attention import prefill_attention, prefill_keys
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, W = 4, 2, 16, 8
    k_all = torch.randn(hkv, start + T, d, generator=g)
    v_all = torch.randn(hkv, start + T, d, generator=g)
    q = torch.randn(T, hq, d, generator=g)
    qpos = torch.arange(start, start + T)
    ref = window_attention(q.transpose(0, 1), k_all, v_all, qpos, W, 1.0).transpose(0, 1)
    k_ring = _ring_from_full(k_all, start - 1, W) if start else torch.zeros(hkv, W, d)
    v_ring = _ring_from_full(v_all, start - 1, W) if start else torch.zeros(hkv, W, d)
    view = prefill_keys(k_all[:, start:].transpose(0, 1), v_all[:, start:].transpose(0, 1),
                        k_ring, v_ring, start, ring=True)
    torch.testing.assert_close(prefill_attention(q, *view, start, W, 1.0), ref)
    torch.testing.assert_close(k_ring, _ring_from_full(k_all, start + T - 1, W))


@pytest.mark.parametrize("split", [False, True], ids=["one_program", "split"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("window,ring", [(None, False), (8, True), (8, False)])
def test_triton_rows_decode_kernel(dtype, tol, window, ring, split):
    """One program per (row, k/v head), or the split form (tiles of 16 slots per program,
    then the merge: rows at 29 and 4 leave empty splits) against the reference."""
    _interpreted()
    from photon_core.ops.sliding_window_attention import (rows_decode_reference,
                                                          rows_decode_triton)
    g = torch.Generator().manual_seed(12)
    hq, hkv, d = 4, 2, 16
    slots = 8 if ring else 40
    k = torch.randn(3, hkv, slots, d, generator=g).to(dtype)
    v = torch.randn(3, hkv, slots, d, generator=g).to(dtype)
    buf = torch.randn(2, hq * d + 5, generator=g).to(dtype)
    q = buf[:, 5:]                                       # a strided segment
    rows, pos = torch.tensor([2, 0]), torch.tensor([29, 4])
    ref = rows_decode_reference(q.float().view(2, hq, d), k.float(), v.float(), rows, pos,
                                window, ring, 1.0, 32)
    out = rows_decode_triton(q, k, v, rows, pos, window, ring, 1.0, torch.empty(2, hq * d,
                                                                               dtype=dtype),
                             attn_len=32, block_n=16, split=split)
    torch.testing.assert_close(out.float().view(2, hq, d), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("with_scale", [False, True])
def test_triton_rmsnorm_residual_kernel(with_scale):
    _interpreted()
    from photon_core.ops.rmsnorm_residual import rmsnorm_residual, rmsnorm_residual_triton
    g = torch.Generator().manual_seed(13)
    src = 3 * torch.randn(3, 64 + 4, generator=g)[:, 4:]
    w = 1 + 0.3 * torch.randn(64, generator=g)
    x = torch.randn(3, 64, generator=g)
    s = torch.tensor([0.7]) if with_scale else None
    ref = rmsnorm_residual(src, w, x, 1e-6, s)
    xf = x.clone()
    assert rmsnorm_residual_triton(src, w, xf, 1e-6, s) is xf
    torch.testing.assert_close(xf, ref, atol=1e-5, rtol=1e-5)
    y = x + rmsnorm_scaled(src, w, 1e-6)
    torch.testing.assert_close(ref, y if s is None else y * 0.7)
    # with the next norm: the same x, and h exactly what the RMSNorm kernel makes of it
    from photon_core.ops.layernorm import rms_norm
    w2 = 1 + 0.2 * torch.randn(64, generator=g)
    x2, h = x.clone(), torch.full((3, 64 + 3), 5.0)
    rmsnorm_residual_triton(src, w, x2, 1e-6, s, next_weight=w2, h=h[:, 3:], next_eps=1e-5)
    assert torch.equal(x2, xf) and (h[:, :3] == 5.0).all()
    assert torch.equal(h[:, 3:], rms_norm(xf, w2, torch.empty(3, 64), 1e-5))


def test_triton_norm_rotary_a_weight_per_head():
    """q and k side by side, each with its own norm weight: one launch."""
    _interpreted()
    from photon_core.ops.rotary_half import norm_rotary_triton
    g = torch.Generator().manual_seed(14)
    hq, hk, d = 4, 2, 16
    x = torch.randn(2, (hq + hk) * d, generator=g)
    qn, kn = 1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g)
    pos = torch.tensor([3, 9])
    cos_t, sin_t = cos_sin(torch.arange(12), inv_freq(d, 1e4), torch.float32)
    out = norm_rotary_triton(x, torch.cat([qn.repeat(hq), kn.repeat(hk)]), cos_t, sin_t, pos, d)
    for sl, w, h in ((slice(0, hq * d), qn, hq), (slice(hq * d, None), kn, hk)):
        ref = apply_rotary_half(rmsnorm_scaled(x[:, sl].view(2, h, d), w, 1e-6), cos_t[pos],
                                sin_t[pos]).reshape(2, -1)
        torch.testing.assert_close(out[:, sl], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kv_slot_write_kernel(ring, dtype):
    """One launch writes each row's k and v at its slot (pos % S on a ring), from strided
    buffer views; the other rows and slots stay as they were."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    from photon_core.ops.kv_slot_write import kv_slot_write_reference, kv_slot_write_triton
    g = torch.Generator().manual_seed(4)
    hkv, S, d = 2, 8 if ring else 40, 32
    buf = torch.randn(3, 5 * hkv * d, generator=g).to(dtype)
    k, v = buf[:, hkv * d:2 * hkv * d], buf[:, 3 * hkv * d:4 * hkv * d]
    ks = torch.randn(4, hkv, S, d, generator=g).to(dtype)
    vs = torch.randn(4, hkv, S, d, generator=g).to(dtype)
    rows, pos = torch.tensor([2, 0, 3]), torch.tensor([29, 3, 17])
    before = ks.clone()
    want_k, want_v = ks.clone(), vs.clone()
    kv_slot_write_reference(k, v, want_k, want_v, rows, pos, ring)
    kv_slot_write_triton(k, v, ks, vs, rows, pos, ring)
    assert torch.equal(ks, want_k) and torch.equal(vs, want_v)
    changed = (ks != before).any(dim=(1, 3))            # [rows, slots] written
    assert changed.sum() == 3 and changed[1].sum() == 0   # row 1 untouched
    assert bool(changed[2, 29 % S if ring else 29])


@pytest.mark.parametrize("shape,budget", [((480, 640), 280), ((97, 130), 70), ((48, 96), 70),
                                          ((1000, 300), 140)])
def test_device_patches_are_preprocess_bit_for_bit(shape, budget):
    """The engine's encode path (model.encode_inputs / encode_body): the raw uint8 frame
    resized on the device by pil_resize.ResizePlan (BICUBIC) to target_size, then
    vision.patches_torch (a lookup in pixel_table, data movement) and grid_positions - the
    patches and positions of preprocess (PIL's resize, / 255 on the host), bit for bit; an
    up- and a downscale, and a frame already at its target size."""
    import numpy as np
    from photon_core.models.gemma4 import vision
    from photon_core.models.gemma4.config import VisionCfg
    from photon_core.pil_resize import ResizePlan
    cfg = VisionCfg(32, 64, 1, 2, 2, 16, 16, 3, 64, 100.0, 1e-6, False, False)
    img = np.random.default_rng(shape[1]).integers(0, 256, (*shape, 3), dtype=np.uint8)
    want, pos, grid = vision.preprocess(img, cfg, budget)
    th, tw = vision.target_size(*shape, cfg.patch_size, cfg.pool, budget)
    assert (th // cfg.patch_size, tw // cfg.patch_size) == grid
    frame = torch.from_numpy(img)
    resized = ResizePlan(*shape, th, tw, "cpu", "bicubic")(frame) if (th, tw) != shape \
        else frame
    got = vision.patches_torch(resized, vision.pixel_table(), cfg.patch_size)
    assert torch.equal(got, want) and torch.equal(vision.grid_positions(*grid), pos)
