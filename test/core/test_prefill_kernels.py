"""The image-prefix prefill's fused kernels on the CPU under the Triton interpreter (fp32 /
fp16): ops/rope_kv_write.py against its torch reference and against the decode kernel's own
k rotation (bitwise: the prefix k in the cache is what decode_attention writes for that
token), ops/add_layernorm.py's t_bias form, and prefix_prefill's fused form (kernels=True)
against the reference prefill and the unfused fast form."""
from __future__ import annotations

import os

import pytest
import torch

from photon_core.ops import HAVE_TRITON

pytestmark = [
    pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tensors need TRITON_INTERPRET=1"),
]


def _qkv(n, t, nh, nkv, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, t, (nh + 2 * nkv) * hd, generator=g) * 2).to(dtype)


def _cache(layers, n, nkv, t, hd, dtype):
    """kv of the prefix buffer's layout [layers, 2, n, nkv, t, hd] filled with NaN, so a
    position the kernel forgets shows."""
    return torch.full((layers, 2, n, nkv, t, hd), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,t,nh,nkv,hd,rot", [(2, 37, 2, 2, 64, 32), (1, 19, 4, 2, 64, 32),
                                               (3, 5, 3, 1, 48, 24), (1, 9, 32, 32, 64, 32)])
def test_rope_kv_write_matches_reference(dtype, n, t, nh, nkv, hd, rot):
    from photon_core.ops.rope import rope_angles
    from photon_core.ops.rope_kv_write import rope_kv_write, rope_kv_write_reference
    qkv = _qkv(n, t, nh, nkv, hd, dtype)
    cos, sin = rope_angles(torch.arange(t + 3), rot)          # a longer table: rows 0..t-1
    kv, kv_ref = _cache(3, n, nkv, t, hd, dtype), _cache(3, n, nkv, t, hd, dtype)
    q = rope_kv_write(qkv, cos, sin, nh, nkv, kv[1, 0], kv[1, 1])
    q_ref = rope_kv_write_reference(qkv, cos, sin, nh, nkv, kv_ref[1, 0], kv_ref[1, 1])
    assert q.shape == (n, t, nh, hd) and q.is_contiguous()
    # only layer 1 written, all of it
    assert torch.isnan(kv[0]).all() and torch.isnan(kv[2]).all()
    assert not torch.isnan(kv[1]).any()
    assert torch.equal(kv[1, 1], kv_ref[1, 1])                # v as it is
    # the pass-through channels exactly, the rotated ones to fp32 rounding (1 ulp of the
    # output dtype: the products' sum rounds differently from apply_rope's)
    assert torch.equal(q[..., rot:], q_ref[..., rot:])
    assert torch.equal(kv[1, 0, ..., rot:], kv_ref[1, 0, ..., rot:])
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for a, b in ((q, q_ref), (kv[1, 0], kv_ref[1, 0])):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * b.float().abs().max().item(), err


def _rotation_formula(qkv, cos, sin, nh, nkv):
    """The decode kernel's rotation (decode_attention.rotary_sources) re-implemented in
    torch: output d = x[src_c] * c + x[src_s] * s in fp32 (two products, one sum: what the
    interpreter computes), rounded once; channels >= rot and v as they are. Returns
    q [n, t, nh, hd], k, v [n, nkv, t, hd]."""
    n, t, width = qkv.shape
    hd = width // (nh + 2 * nkv)
    half = cos.shape[-1]
    x = qkv.reshape(n, t, nh + 2 * nkv, hd)
    d = torch.arange(hd)
    rot, even = d < 2 * half, d % 2 == 0
    fi = torch.where(rot, d // 2, 0)
    src_c = torch.where(rot, torch.where(even, fi, fi + half), d)
    src_s = torch.where(rot, torch.where(even, fi + half, fi), d)
    c = torch.where(rot, cos[:t][:, fi], 1.0)[None, :, None, :]
    s = sin[:t][:, fi]
    s = torch.where(rot, torch.where(even, -s, s), 0.0)[None, :, None, :]
    xf = x.float()
    r = (xf[..., src_c] * c + xf[..., src_s] * s).to(qkv.dtype)
    qk = torch.where(rot, r, x)
    return (qk[:, :, :nh], qk[:, :, nh:nh + nkv].transpose(1, 2),
            x[:, :, nh + nkv:].transpose(1, 2))


_ROPE_SHAPES = [
    (2, 37, 4, 2, 64, 32, 8, 32),        # GQA, T % 8 = 5
    (3, 13, 3, 1, 48, 24, 4, 2),         # head 48 (pair halves of 12), heads split 2 + 1
    (2, 5, 2, 2, 64, 32, 16, 32),        # one partial token block
    (1, 21, 6, 3, 32, 32, 1, 4),         # rot = head (no pass-through channels), 1 token
    (2, 19, 8, 8, 64, 16, 2, 8),         # rot 16 of 64
]


@pytest.mark.parametrize("dtype,n,t,nh,nkv,hd,rot,tokens,heads", [
    # the real shape (T not a multiple of 4 or 8) in fp32 only: ~7 s in the interpreter
    (torch.float32, 1, 730, 32, 32, 64, 32, 4, 32)] + [
    (dt, *shape) for dt in (torch.float32, torch.float16) for shape in _ROPE_SHAPES])
def test_rope_kv_write_is_the_decode_formula_bitwise(dtype, n, t, nh, nkv, hd, rot, tokens,
                                                     heads):
    """Blocks of tokens x heads (partial at the ends), the rotation's pairs interleaved in
    registers: bitwise the decode kernel's formula, into strided cache views, nothing else
    written."""
    from photon_core.ops.rope import rope_angles
    from photon_core.ops.rope_kv_write import rope_kv_write
    qkv = _qkv(n, t, nh, nkv, hd, dtype, seed=t)
    cos, sin = rope_angles(torch.arange(t + 2), rot)
    q_ref, k_ref, v_ref = _rotation_formula(qkv, cos, sin, nh, nkv)
    kv = _cache(2, n, nkv, t, hd, dtype)
    q = rope_kv_write(qkv, cos, sin, nh, nkv, kv[1, 0], kv[1, 1], heads_per_program=heads,
                      tokens_per_program=tokens)
    assert torch.equal(q, q_ref)
    assert torch.equal(kv[1, 0], k_ref) and torch.equal(kv[1, 1], v_ref)
    assert torch.isnan(kv[0]).all()
    # caches of other layouts: a longer capacity (rows past t untouched), token-major heads
    big = torch.full((2, n, nkv, t + 3, hd), float("nan"), dtype=dtype)
    tm = torch.full((n, t, 2, nkv, hd), float("nan"), dtype=dtype)
    rope_kv_write(qkv, cos, sin, nh, nkv, big[0, :, :, :t], tm[:, :, 1].transpose(1, 2),
                  heads_per_program=heads, tokens_per_program=tokens)
    assert torch.equal(big[0, :, :, :t], k_ref) and torch.isnan(big[0, :, :, t:]).all()
    assert torch.isnan(big[1]).all()
    assert torch.equal(tm[:, :, 1].transpose(1, 2), v_ref) and torch.isnan(tm[:, :, 0]).all()


def test_rope_kv_write_k_is_the_decode_kernels_k():
    """For every prefix position, the k this kernel writes is bitwise the k the decode
    kernel (decode_attention._attend_partial_kernel) writes for the same qkv row at that
    position: the cache stays the decode step's."""
    from photon_core.ops.decode_attention import AttentionScratch, decode_attention
    from photon_core.ops.rope import rope_angles
    from photon_core.ops.rope_kv_write import rope_kv_write
    n, t, nh, nkv, hd, rot = 1, 12, 4, 2, 64, 32
    for dtype in (torch.float32, torch.float16):
        qkv = _qkv(n, t, nh, nkv, hd, dtype, seed=3)
        cos, sin = rope_angles(torch.arange(t), rot)
        kv = _cache(1, n, nkv, t, hd, dtype)
        rope_kv_write(qkv, cos, sin, nh, nkv, kv[0, 0], kv[0, 1])
        # decode: row b holds token b's qkv at position b, in a cache of t rows
        kc, vc = torch.zeros(t, nkv, t, hd, dtype=dtype), torch.zeros(t, nkv, t, hd, dtype=dtype)
        scratch = AttentionScratch(t, nh, hd, t, 16, "cpu")
        out = torch.empty(t, nh * hd, dtype=dtype)
        decode_attention(qkv[0].contiguous(), torch.arange(t), cos, sin, kc, vc, out, scratch,
                         nh, nkv, hd)
        for p in range(t):
            assert torch.equal(kc[p, :, p], kv[0, 0, 0, :, p]), (dtype, p)
            assert torch.equal(vc[p, :, p], kv[0, 1, 0, :, p]), (dtype, p)


def test_rope_kv_write_rejects_bad_shapes():
    from photon_core.ops.rope import rope_angles
    from photon_core.ops.rope_kv_write import rope_kv_write
    qkv = _qkv(1, 8, 2, 2, 64, torch.float32)
    cos, sin = rope_angles(torch.arange(8), 32)
    kv = _cache(1, 1, 2, 8, 64, torch.float32)
    with pytest.raises(ValueError):
        rope_kv_write(qkv[..., :-1], cos, sin, 2, 2, kv[0, 0], kv[0, 1])
    with pytest.raises(ValueError):
        rope_kv_write(qkv, cos[:7], sin[:7], 2, 2, kv[0, 0], kv[0, 1])
    with pytest.raises(ValueError):
        rope_kv_write(qkv, cos, sin, 2, 2, kv[0, 0, :, :1], kv[0, 1])
    with pytest.raises(ValueError):
        rope_kv_write(qkv, cos, sin, 2, 2, kv[0, 0].transpose(-1, -2), kv[0, 1])
    with pytest.raises(ValueError):
        rope_kv_write(qkv, cos, sin, 2, 2, kv[0, 0], kv[0, 1], tokens_per_program=0)
    with pytest.raises(ValueError):
        rope_kv_write(qkv, cos, sin, 2, 2, kv[0, 0], kv[0, 1], heads_per_program=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layernorm_t_bias(dtype):
    from photon_core.ops.add_layernorm import add_layernorm, add_layernorm_reference
    g = torch.Generator().manual_seed(1)
    x, t = (torch.randn(3, 11, 96, generator=g).to(dtype) for _ in range(2))
    w, b, tb = (torch.randn(96, generator=g).to(dtype) for _ in range(3))
    s, h = add_layernorm(x, t, w, b, t_bias=tb)
    s_ref, h_ref = add_layernorm_reference(x, t, w, b, t_bias=tb)
    assert torch.equal(s, s_ref)                             # one fp32 sum, rounded once
    assert not torch.equal(s, add_layernorm(x, t, w, b)[0])  # the bias is added
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (h.float() - h_ref.float()).abs().max().item() <= tol * h_ref.float().abs().max()


@pytest.fixture(scope="module")
def model():
    from photon_core.models.moondream2.test_model import TEST_EOS_BIAS, tiny_config
    from photon_core.moondream.model import build_random_model
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


def test_fused_prefill_matches_reference_prefill(model):
    """prefill_prefix(fast=True, kernels=True) (the Triton kernels, interpreter, fp32) vs the
    reference prefill (span attention) and the unfused fast form: the same math, other
    roundings: close (fp32), every layer's k/v written."""
    from photon_core.models.moondream2 import batched_encode
    from photon_core.models.moondream2.prefix_prefill import prefill_prefix
    t, w = model.config.text, model.weights
    x = torch.randn(2, model.prefix_len, t.dim, generator=torch.Generator().manual_seed(5))
    ref, fast, fused = (batched_encode.kv_buffer(model, 2) for _ in range(3))
    fused.fill_(float("nan"))
    with torch.inference_mode():
        h_ref = prefill_prefix(w, t, x, ref, model.prefix_len)
        h_fast = prefill_prefix(w, t, x, fast, model.prefix_len, fast=True, kernels=False)
        h = prefill_prefix(w, t, x, fused, model.prefix_len, fast=True, kernels=True)
    assert not torch.isnan(fused).any()
    scale = ref.abs().max().item()
    for other in (ref, fast):
        err = (fused - other).abs().max().item()
        assert err <= 1e-5 * scale, err
    assert not torch.equal(fused, fast)                       # not the same code
    assert (h - h_ref).abs().max().item() <= 1e-5 * h_ref.abs().max().item()
    assert (h - h_fast).abs().max().item() <= 1e-5 * h_ref.abs().max().item()
    # one frame alone gives that frame's k/v of the batch
    one = batched_encode.kv_buffer(model, 1)
    with torch.inference_mode():
        prefill_prefix(w, t, x[1:], one, model.prefix_len, fast=True, kernels=True)
    assert torch.allclose(one[:, :, 0], fused[:, :, 1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        prefill_prefix(w, t, x, fused, model.prefix_len, kernels=True)   # not fast


def test_fused_prefill_without_hidden_writes_the_same_kv(model, monkeypatch):
    """hidden=False (the runtime's encode): the fused form stops at the last k/v write - the
    last layer runs its norm and qkv GEMM only (no fc1, attention, projection, fc2) - and
    every layer's k/v is bitwise the k/v of the whole pass."""
    from photon_core.models.moondream2 import batched_encode
    from photon_core.models.moondream2 import prefix_prefill as pp
    t, w = model.config.text, model.weights
    x = torch.randn(2, model.prefix_len, t.dim, generator=torch.Generator().manual_seed(7))
    whole, cut = (batched_encode.kv_buffer(model, 2) for _ in range(2))
    cut.fill_(float("nan"))
    calls = {"gelu": 0, "sdpa": 0}
    gelu, sdpa = pp.linear_gelu, pp.F.scaled_dot_product_attention

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(pp, "linear_gelu", count("gelu", gelu))
    monkeypatch.setattr(pp.F, "scaled_dot_product_attention", count("sdpa", sdpa))
    with torch.inference_mode():
        h = pp.prefill_prefix(w, t, x, whole, model.prefix_len, fast=True, kernels=True)
        assert calls == {"gelu": t.n_layers, "sdpa": t.n_layers} and h is not None
        got = pp.prefill_prefix(w, t, x, cut, model.prefix_len, fast=True, kernels=True,
                                hidden=False)
    assert got is None and calls == {"gelu": 2 * t.n_layers - 1, "sdpa": 2 * t.n_layers - 1}
    assert torch.equal(cut, whole)
    ops = pp.kv_ops(pp.decoder_ops(t))
    assert [op.kind for op in ops[-4:]] == ["residual", "norm", "linear", "attention"]
    assert ops[-2].dst == ("qkv",) and ops[-1].dst == ()


def test_fused_prefill_fp16_close(model):
    """fp16 (the interpreter's reduced precision): close to the reference prefill."""
    from photon_core.models.moondream2 import batched_encode
    from photon_core.models.moondream2.layers import Weights
    from photon_core.models.moondream2.prefix_prefill import prefill_prefix
    t = model.config.text
    w16 = Weights({k: v.half() for k, v in model.weights.items()})
    x = torch.randn(1, model.prefix_len, t.dim, generator=torch.Generator().manual_seed(6))
    ref = batched_encode.kv_buffer(model, 1)
    fused = ref.half()
    with torch.inference_mode():
        prefill_prefix(model.weights, t, x, ref, model.prefix_len)
        prefill_prefix(w16, t, x.half(), fused, model.prefix_len, fast=True, kernels=True)
    err = (fused.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,t,heads,hd,config", [(2, 37, 3, 72, (32, 16, 4, 1)),
                                                 (1, 150, 2, 72, (64, 32, 4, 2)),
                                                 (1, 29, 2, 16, (16, 16, 4, 1)),
                                                 (3, 20, 1, 32, None)])
def test_vision_attention_matches_sdpa(dtype, n, t, heads, hd, config):
    """ops/vision_attention.py (split 64 + 16 head, online softmax over key blocks, keys past
    T masked) against SDPA over the views, under the interpreter."""
    from photon_core.ops.vision_attention import vision_attention, vision_attention_reference
    g = torch.Generator().manual_seed(t)
    qkv = (torch.randn(n, t, 3 * heads * hd, generator=g) * 1.5).to(dtype)
    o = vision_attention(qkv, heads, config)
    ref = vision_attention_reference(qkv.float(), heads)
    assert o.shape == (n, t, heads * hd) and o.is_contiguous() and o.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    err = (o.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), err
    with pytest.raises(ValueError):
        vision_attention(qkv[..., :-1], heads)


@pytest.mark.parametrize("config", [(32, 16, 4, 1), (16, 32, 4, 1)])
def test_vision_attention_crops_do_not_leak(config):
    """A crop's output is its own: inf / NaN in the next crop's rows (beside the last key
    block's and query block's rows past T) change nothing in the other crop's output."""
    from photon_core.ops.vision_attention import vision_attention, vision_attention_reference
    n, t, heads, hd = 2, 37, 3, 72
    qkv = torch.randn(n, t, 3 * heads * hd, generator=torch.Generator().manual_seed(4))
    bad = qkv.clone()
    bad[1, :5] = float("inf")
    bad[1, 5:9] = float("nan")
    o = vision_attention(bad, heads, config)
    ref = vision_attention_reference(qkv.float(), heads)
    assert torch.isfinite(o[0]).all()
    assert (o[0] - ref[0]).abs().max().item() <= 2e-5 * ref[0].abs().max().item()


def test_vision_encoder_triton_attention_close(model):
    """vision_fused.encoder(attention="triton") (interpreter, fp32) against vision.encoder."""
    import numpy as np

    from photon_core.models.moondream2 import vision, vision_fused
    img = np.random.default_rng(3).integers(0, 256, (90, 200, 3), dtype=np.uint8)
    _, x, _ = model.image_crops(img)
    w, v = model.weights, model.config.vision
    with torch.inference_mode():
        ref = vision.encoder(w, v, x)
        got = vision_fused.encoder(w, v, x, fuse_norms=True, attention="triton",
                                   attention_config=(16, 16, 4, 1))
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    with pytest.raises(ValueError):
        vision_fused.encoder(w, v, x, attention="flash")


def test_vision_encoder_gluon_attention_needs_hopper(model):
    """attention="gluon" (ops/vision_attention_gluon.py) where no Hopper GPU is: a clear
    error naming the forms that run here, not a crash inside Triton."""
    import numpy as np

    from photon_core.models.moondream2 import vision_fused
    img = np.random.default_rng(3).integers(0, 256, (90, 200, 3), dtype=np.uint8)
    _, x, _ = model.image_crops(img)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="Hopper.*'sdpa'"):
        vision_fused.encoder(model.weights, model.config.vision, x, attention="gluon")


def test_vision_encoder_auto_attention_is_sdpa_without_hopper(model):
    """attention="auto" (vision_fused.ATTENTION's default) where the Gluon kernel cannot run
    (no Hopper GPU here): the SDPA form, bit for bit, and ops/vision_attention_gluon.takes
    says no."""
    import numpy as np

    from photon_core.models.moondream2 import vision_fused
    from photon_core.ops.vision_attention_gluon import takes
    img = np.random.default_rng(4).integers(0, 256, (90, 200, 3), dtype=np.uint8)
    _, x, _ = model.image_crops(img)
    w, v = model.weights, model.config.vision
    assert not takes(torch.empty(1, 5, 3 * 2 * 72, dtype=torch.bfloat16), 2)
    with torch.inference_mode():
        auto = vision_fused.encoder(w, v, x, attention="auto")
        sdpa = vision_fused.encoder(w, v, x, attention="sdpa")
        default = vision_fused.encoder(w, v, x)
    assert torch.equal(auto, sdpa) and torch.equal(default, sdpa)


def test_gluon_vision_attention_configs():
    """ops/vision_attention_gluon.parse_config / full_config: "BMxBNxSTAGES[xPIPE[xWS]]"
    with defaults for the missing values, WS 0 or "wg" (BM 128 / 256, no PIPE);
    anything else a ValueError."""
    from photon_core.ops.vision_attention_gluon import CONFIG, full_config, parse_config
    assert parse_config("128x64x2") == (128, 64, 2, False, 0)
    assert parse_config("64x32x4x1") == (64, 32, 4, True, 0)
    assert parse_config("256x64x2x0xwg") == (256, 64, 2, False, "wg")
    assert full_config(None) == full_config(CONFIG)
    for bad in ("64x64x2x0xwg", "128x64x2x1xwg", "128x64x2x0x1", "128x64x2x0xws"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_gluon_vision_attention_shape_check():
    """ops/vision_attention_gluon.check_shape: what the Gluon kernel takes (head 64 < hd <=
    80, bf16 / fp16, each head's columns on 16 bytes for TMA), else a ValueError."""
    from photon_core.ops.vision_attention_gluon import check_shape
    e = torch.empty
    assert check_shape(e(9, 729, 3 * 16 * 72, dtype=torch.bfloat16), 16) == (9, 729, 72)
    assert check_shape(e(1, 5, 3 * 2 * 80, dtype=torch.float16), 2) == (1, 5, 80)
    for bad, heads in ((e(1, 5, 3 * 2 * 64, dtype=torch.bfloat16), 2),     # head 64
                       (e(1, 5, 3 * 2 * 72), 2),                           # fp32
                       (e(1, 5, 3 * 1 * 65, dtype=torch.bfloat16), 1),     # head 65 (odd)
                       (e(1, 5, 3 * 4 * 68, dtype=torch.bfloat16), 4),     # head at 136 B
                       (e(1, 5, 3 * 2 * 76, dtype=torch.float16), 2),      # head at 152 B
                       (e(1, 5, 100, dtype=torch.bfloat16), 16)):          # not 3 H hd
        with pytest.raises(ValueError):
            check_shape(bad, heads)
