"""ops/resample_pass.py and ops/crop_normalize.py: the Triton kernels of the on-device crops
give the torch forms' bytes / bits (CPU: Triton's interpreter; on a GPU the same cases run on
CUDA, and Moondream 2's device_crops with the kernels equals the torch ops' crops)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from photon_core import pil_resize as L  # noqa: E402
from photon_core.models.moondream2 import crops as C  # noqa: E402
from photon_core.models.moondream2 import vision  # noqa: E402
from photon_core.ops.crop_normalize import (crop_normalize, crop_normalize_reference,  # noqa: E402
                                            pixel_lut)
from photon_core.ops.resample_pass import resample_pass, resample_pass_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _image(h, w, seed):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).to(DEV)


@pytest.mark.parametrize("filt", ["lanczos", "bicubic"])
@pytest.mark.parametrize("h,w,out_h,out_w", [(37, 53, 90, 120), (97, 251, 40, 60),
                                             (64, 48, 13, 200), (30, 30, 7, 5)])
def test_resample_pass_gives_the_torch_bytes(filt, h, w, out_h, out_w):
    """Each axis, up- and downscaling (downscaling widens the filter: more taps, clamped at
    the edges), images with saturated pixels (where the filters overshoot 0 / 255)."""
    x = _image(h, w, h * w)
    x[: h // 3] = 255
    x[:, : w // 4] = 0
    for dim, size in ((0, out_h), (1, out_w)):
        index, weights = L._device_tables(x.shape[dim], size, torch.device(DEV), filt)
        got = resample_pass(x, dim, index, weights)
        want = resample_pass_reference(x, dim, index, weights)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert torch.equal(got, want), (dim, (got.int() - want.int()).abs().max())


def test_resample_pass_then_pil():
    """The two passes in Pillow's order through the kernel are PIL's resize."""
    from PIL import Image
    x = _image(61, 83, 5)
    plan = L.ResizePlan(61, 83, 40, 150, DEV)
    y = x
    for dim, _size, (index, weights) in plan.passes:
        y = resample_pass(y, dim, index, weights)
    want = np.asarray(Image.fromarray(x.cpu().numpy()).resize((150, 40),
                                                              Image.Resampling.LANCZOS))
    assert np.array_equal(y.cpu().numpy(), want)


def test_resample_pass_rejects_bad_input():
    x = _image(8, 8, 0)
    index, weights = L._device_tables(8, 4, torch.device(DEV))
    with pytest.raises(ValueError, match="uint8"):
        resample_pass(x.float(), 0, index, weights)
    with pytest.raises(ValueError, match="taps"):
        resample_pass(x, 0, index[:-1], weights)


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pixel_lut_is_normalize(dtype):
    lut = pixel_lut(vision.normalize, DEV, dtype)
    img = torch.arange(256, dtype=torch.uint8, device=DEV).view(1, 16, 16, 1).expand(
        1, 16, 16, 3)
    assert lut.shape == (256,) and lut.dtype == dtype
    assert torch.equal(lut[img[0, :, :, 0].long()], vision.normalize(img, DEV, dtype)[0, 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["overlap", "global", "overlap:4"])
def test_crop_normalize_gives_the_torch_crops(dtype, mode):
    """CropPlan.normalized (the resizes, then the one crop kernel) = normalize(CropPlan(...))
    bit for bit, written into a slice of a bigger buffer as the graphed encoder does."""
    frame = _image(97, 251, 1)
    plan = C.CropPlan(97, 251, mode, 84, 14, 1, 8, DEV)
    lut = pixel_lut(vision.normalize, DEV, dtype)
    want = vision.normalize(plan(frame), DEV, dtype)
    buf = torch.full((plan.n_crops + 2, 3, 84, 84), 7.0, dtype=dtype, device=DEV)
    got = plan.normalized(frame, lut, out=buf[1:1 + plan.n_crops])
    assert got.data_ptr() == buf[1].data_ptr()
    assert torch.equal(got, want)
    assert (buf[0] == 7).all() and (buf[-1] == 7).all()      # nothing written past the slice
    assert torch.equal(plan.normalized(frame, lut), want)


def test_crop_normalize_cuts_tiles_at_the_edge():
    """A tile reaching past the resized image is zero there (normalize(0) = -1), as the
    torch form's zero-filled crops."""
    g = _image(28, 28, 2)
    big = _image(40, 45, 3)           # 2 x 2 tiles of 28 at a 20-pixel window: cut at both edges
    lut = pixel_lut(vision.normalize, DEV, torch.float32)
    got = crop_normalize(g, big, (2, 2), 20, lut)
    want = crop_normalize_reference(g, big, (2, 2), 20, vision.normalize, torch.float32)
    assert torch.equal(got, want)
    assert (got[4, :, 20:, :] == -1).all() and (got[2, :, :, 25:] == -1).all()
    assert (got[4, :, :20, :25] != -1).any() and (got[2, :, :, :25] != -1).any()
    only = crop_normalize(g, None, (1, 1), 20, lut)
    assert torch.equal(only, crop_normalize_reference(g, None, (1, 1), 20, vision.normalize,
                                                      torch.float32))
    with pytest.raises(ValueError, match="out"):
        crop_normalize(g, big, (2, 2), 20, lut, out=torch.empty(4, 3, 28, 28, device=DEV))
    with pytest.raises(ValueError, match="global view"):
        crop_normalize(g[:27], big, (2, 2), 20, lut)


@pytest.mark.skipif(DEV != "cuda", reason="the model's CUDA path")
def test_device_crops_with_the_kernels_on_gpu(monkeypatch):
    """Moondream 2's device_crops with the two Triton kernels (pil_resize.TRITON_PASS,
    crops.TRITON_CROPS) = the torch ops' crops, bit for bit, and the PIL crops."""
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.model import build_random_model
    cfg = MoondreamConfig.from_dict({"text": {"n_layers": 1}, "vision": {"enc_n_layers": 1}})
    m = build_random_model(cfg, device="cuda", dtype="bf16", seed=0)
    frame = _image(480, 640, 4)
    for mode in ("overlap", "global", "overlap:4"):
        plan = m.crop_plan(480, 640, mode)
        monkeypatch.setattr(L, "TRITON_PASS", False)
        monkeypatch.setattr(C, "TRITON_CROPS", False)
        want = m.device_crops(frame, plan)
        monkeypatch.setattr(L, "TRITON_PASS", True)
        monkeypatch.setattr(C, "TRITON_CROPS", True)
        got = m.device_crops(frame, plan)
        assert torch.equal(got, want), mode
        pil, _ = (C.overlap_crops(frame.cpu().numpy(), cfg.vision.crop_size, 14, 4,
                                  int(mode.split(":")[1]) if ":" in mode else 12)
                  if mode != "global" else (C.global_crop(frame.cpu().numpy(), 378), None))
        assert torch.equal(got, vision.normalize(pil, "cuda", torch.bfloat16)), mode
