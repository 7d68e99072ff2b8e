"""The Gluon vision attention (ops/vision_attention_gluon.py) on a Hopper GPU (skipped
elsewhere: Gluon kernels do not run under the interpreter; test_sm90_resources.py compiles
them on the CPU): against SDPA over the views (fp32 reference) at Moondream 2's 9-crop shape
and at small odd ones, the configs bench/probe_gluon_attention.py timed first and the
per-warpgroup form (the default); a crop's output is its own (inf / NaN in the next crop change
nothing); the vision encoder with it stays close to the SDPA encoder."""
from __future__ import annotations

import pytest
import torch

from photon_core.ops import vision_attention_gluon as G

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and G.gluon_available(torch.empty(1, device="cuda"))),
    reason="needs a Hopper GPU and a Triton with Gluon")

CONFIGS = [(64, 64, 2, 0), (64, 64, 3, 0), (64, 128, 2, 0), (128, 64, 2, 0),
           (64, 64, 2, 1), (64, 64, 3, 1), (128, 64, 3, 1), (64, 32, 4, 1),
           # a partition per warpgroup (2 / 4 warpgroups sharing the K / V slots)
           (128, 64, 2, 0, "wg"), (256, 64, 3, 0, "wg"), (128, 32, 4, 0, "wg")]


def _qkv(n, t, heads, hd, dtype, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(n, t, 3 * heads * hd, device="cuda", generator=g) * 2).to(dtype)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,t,heads,hd,dtype", [(9, 729, 16, 72, torch.bfloat16),
                                                (2, 37, 3, 72, torch.bfloat16),
                                                (1, 150, 2, 80, torch.float16),
                                                (3, 64, 4, 72, torch.float16)])
def test_gluon_vision_attention_matches_sdpa(config, n, t, heads, hd, dtype):
    from photon_core.ops.vision_attention import vision_attention_reference
    qkv = _qkv(n, t, heads, hd, dtype, t)
    o = G.vision_attention_gluon(qkv, heads, config)
    ref = vision_attention_reference(qkv.float(), heads)
    assert o.shape == (n, t, heads * hd) and o.is_contiguous() and o.dtype == dtype
    err = (o.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= (1e-2 if dtype == torch.bfloat16 else 4e-3), err


@pytest.mark.parametrize("config", [(64, 64, 2, 0), (64, 64, 2, 1), (64, 32, 4, 1),
                                    (128, 64, 2, 0, "wg"),
                                    (256, 64, 2, 0, "wg")])
def test_gluon_vision_attention_crops_do_not_leak(config):
    from photon_core.ops.vision_attention import vision_attention_reference
    n, t, heads, hd = 2, 37, 3, 72
    qkv = _qkv(n, t, heads, hd, torch.bfloat16, 4)
    bad = qkv.clone()
    bad[1, :5] = float("inf")
    bad[1, 5:9] = float("nan")
    o = G.vision_attention_gluon(bad, heads, config)
    ref = vision_attention_reference(qkv.float(), heads)
    assert torch.isfinite(o[0]).all()
    assert (o[0].float() - ref[0]).abs().max().item() <= 1e-2 * ref[0].abs().max().item()


def test_vision_encoder_with_gluon_attention_is_close_to_sdpa():
    """Moondream 2's vision tower at real shapes (random bf16 weights, a 640x480 frame's
    crops): attention="gluon" against "sdpa", both through vision_fused.encoder; "auto" is
    "gluon" here."""
    import numpy as np

    from photon_core.models.moondream2 import vision_fused
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.moondream.model import build_random_model
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    _, x, _ = m.image_crops(frame)
    w, v = m.weights, m.config.vision
    with torch.inference_mode():
        ref = vision_fused.encoder(w, v, x, attention="sdpa").float()
        got = vision_fused.encoder(w, v, x, attention="gluon").float()
        auto = vision_fused.encoder(w, v, x, attention="auto").float()
    assert torch.equal(auto, got)           # "auto" (the default) takes the Gluon kernel here
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 5e-2, err
