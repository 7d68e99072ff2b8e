"""pil_resize (torch) against PIL's LANCZOS and BICUBIC resizes, pixel for pixel, and the torch
overlap crops / model.image_crops against the PIL ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from photon_core.moondream import vision
from photon_core.moondream.crops import overlap_crops, overlap_crops_tensor
from photon_core.pil_resize import (FILTERS, PRECISION_BITS, _vertical_first, coefficients,
                                    resize_bicubic, resize_lanczos)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


PIL_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC}
TORCH = {"lanczos": resize_lanczos, "bicubic": resize_bicubic}


def pil_resize(image: np.ndarray, height: int, width: int, filt="lanczos") -> np.ndarray:
    mode = "L" if image.shape[2] == 1 else "RGB"
    out = Image.fromarray(image[..., 0] if mode == "L" else image, mode).resize(
        (width, height), PIL_FILTERS[filt])
    return np.asarray(out).reshape(height, width, image.shape[2])


def torch_resize(image: np.ndarray, height: int, width: int, device="cpu",
                 filt="lanczos") -> np.ndarray:
    return TORCH[filt](torch.from_numpy(image).to(device), height, width).cpu().numpy()


def contents(h: int, w: int, seed: int = 0, channels: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    yy, xx = np.indices((h, w))
    checker = ((yy + xx) % 2 * 255).astype(np.uint8)
    return {
        "random": rng.integers(0, 256, (h, w, channels), dtype=np.uint8),
        "zeros": np.zeros((h, w, channels), np.uint8),
        "full": np.full((h, w, channels), 255, np.uint8),
        "checker": np.repeat(checker[..., None], channels, axis=2),
        # stripes of 0/255 one pixel wide along each axis: the most overshoot per pass
        "stripes": np.stack([(xx % 2 * 255), (yy % 2 * 255), (yy // 3 % 2 * 255)][:channels],
                            axis=-1).astype(np.uint8),
        "gradient": np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1),
                              (xx + yy) % 256][:channels], axis=-1).astype(np.uint8),
    }


def assert_same(image: np.ndarray, height: int, width: int, device="cpu", filt="lanczos"):
    want = pil_resize(image, height, width, filt)
    got = torch_resize(image, height, width, device, filt)
    assert got.shape == want.shape == (height, width, image.shape[2])
    if not np.array_equal(got, want):
        diff = np.argwhere(got != want)
        pytest.fail(f"{filt} {image.shape[:2]} -> {(height, width)}: {len(diff)} pixels differ, "
                    f"first at {diff[0].tolist()}: torch {got[tuple(diff[0])]} "
                    f"PIL {want[tuple(diff[0])]}")


SIZES = [
    # (in h, in w) -> (out h, out w)
    ((480, 640), (378, 378)),       # the moondream global view of a 640x480 frame
    ((480, 640), (644, 1176)),      # ... and its big resize before the crops
    ((640, 480), (378, 378)),       # portrait: Pillow 13 does the vertical pass first
    ((640, 480), (1176, 644)),
    ((37, 53), (11, 17)),           # downscale both, odd sizes
    ((11, 17), (37, 53)),           # upscale both
    ((40, 30), (13, 70)),           # down one axis, up the other
    ((30, 40), (70, 13)),
    ((50, 31), (50, 7)),            # height unchanged: horizontal pass only
    ((50, 31), (9, 31)),            # width unchanged: vertical pass only
    ((23, 29), (23, 29)),           # both unchanged: a copy
    ((1, 1), (5, 3)), ((1, 1), (1, 2)), ((2, 3), (1, 1)), ((3, 2), (7, 1)),
    ((1, 40), (3, 7)), ((40, 1), (7, 3)), ((2, 2), (3, 3)), ((3, 3), (2, 2)),
    ((301, 7), (9, 5)),             # strong vertical shrink of a tall image
    ((7, 301), (5, 9)),
    ((101, 100), (100, 101)),       # scale ~1: filterscale 1 vs just above
    ((99, 97), (33, 97 * 3)),       # exact integer factors
    ((480, 640), (672, 912)),       # Gemma 4's image processor on a 640x480 frame (BICUBIC)
    ((480, 640), (448, 608)),       # Qwen 3.5's smart_resize of a 640x480 frame under a budget
]


@pytest.mark.parametrize("filt", list(FILTERS))
@pytest.mark.parametrize("src,dst", SIZES, ids=[f"{s[0]}x{s[1]}-{d[0]}x{d[1]}" for s, d in SIZES])
def test_matches_pil(src, dst, filt):
    for name, image in contents(*src, seed=src[0] * 1000 + src[1]).items():
        assert_same(image, *dst, filt=filt)


@pytest.mark.parametrize("filt", list(FILTERS))
def test_matches_pil_random_sizes(filt):
    """300 random size pairs (1..90 px in, 1..130 px out), random content."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(1, 91, 2))
        oh, ow = (int(v) for v in rng.integers(1, 131, 2))
        assert_same(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), oh, ow, filt=filt)


@pytest.mark.parametrize("filt,bound", [("lanczos", 1.5715), ("bicubic", 1.269)])
def test_no_int32_overflow(filt, bound):
    """The module's claim: sum |w| of every output's taps stays under its bound for all
    (in, out) sizes 1..159, far from the 2.006 an int32 overflow would need."""
    worst = max(np.abs(coefficients(i, o, filt)[1]).sum(axis=1).max()
                for i in range(1, 160) for o in range(1, 160)) / (1 << PRECISION_BITS)
    assert worst <= bound, worst


def test_chunked_passes_match_pil(monkeypatch):
    """Large frames resample in chunks of output positions (bounded memory): forced tiny
    chunks (1 and 7 positions) give PIL's pixels for up- and downscales."""
    from photon_core import pil_resize as LR

    rng = np.random.default_rng(11)
    image = rng.integers(0, 256, (61, 83, 3), dtype=np.uint8)
    for chunk in (1, 7 * 83 * 3 * 13):
        monkeypatch.setattr(LR, "CHUNK_ELEMENTS", chunk)
        for oh, ow in ((40, 29), (97, 130), (61, 50)):
            assert_same(image, oh, ow)
            assert_same(image, oh, ow, filt="bicubic")


def test_single_channel_matches_pil_mode_l():
    for image in contents(33, 47, channels=1).values():
        assert_same(image, 20, 61)
        assert_same(image, 20, 61, filt="bicubic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_matches_pil_on_cuda():
    for src, dst in SIZES:
        for filt in FILTERS:
            assert_same(contents(*src)["random"], *dst, device="cuda", filt=filt)


def test_result_on_input_device_and_fresh():
    image = torch.from_numpy(contents(9, 9)["random"])
    same = resize_lanczos(image, 9, 9)
    assert torch.equal(same, image) and same.data_ptr() != image.data_ptr()
    with pytest.raises(ValueError):
        resize_lanczos(image.float(), 4, 4)


def test_fixed_point_weights_sum_to_one():
    """Every output's int weights sum to 2^22 up to the rounding of each weight."""
    for n_in, n_out in ((640, 378), (480, 1176), (7, 300), (300, 7), (1, 1), (5, 4)):
        first, weights = coefficients(n_in, n_out)
        sums = weights.astype(np.int64).sum(axis=1)
        assert np.all(np.abs(sums - (1 << PRECISION_BITS)) <= weights.shape[1])
        assert first.min() >= 0 and first.max() < n_in


def test_pass_order_rules():
    assert not _vertical_first(640, 480, 378, 378, (12, 1))
    assert not _vertical_first(640, 480, 378, 378, (12, 2))
    assert _vertical_first(20000, 100, 300, 100, (12, 2))
    assert _vertical_first(640, 480, 378, 378, (13, 0))       # 262 > 2 * 102
    assert not _vertical_first(480, 640, 378, 378, (13, 0))
    assert not _vertical_first(480, 640, 644, 1176, (13, 0))


# -- overlap crops -------------------------------------------------------------------------
@pytest.mark.parametrize("h,w", [(480, 640), (640, 480), (720, 1280), (120, 160), (378, 378),
                                 (379, 2000), (50, 30)])
def test_overlap_crops_tensor_equals_pil(h, w):
    frame = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    want, tiling = overlap_crops(frame, 378, 14, 4, 12)
    got, got_tiling = overlap_crops_tensor(torch.from_numpy(frame), 378, 14, 4, 12)
    assert got_tiling == tiling
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)


def test_normalize_accepts_tensor():
    crops = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(vision.normalize(torch.from_numpy(crops), "cpu", dtype),
                           vision.normalize(crops, "cpu", dtype))


def _real_size_model(dtype):
    """A random model with moondream's real crop geometry (378 px, margin 4, 12 crops)."""
    from photon_core.moondream.model import MoondreamModel
    from photon_core.moondream.test_model import build_test_tokenizer, tiny_config
    from photon_core.moondream.weights import random_weights

    tok = build_test_tokenizer()
    cfg = tiny_config(tok)
    return MoondreamModel(cfg, random_weights(cfg, "cpu", dtype), tok)


@pytest.mark.parametrize("which", ["fast", "real-fp32", "real-bf16"])
def test_image_crops_torch_equals_pil(which, fast_model, monkeypatch):
    model = {"fast": lambda: fast_model, "real-fp32": lambda: _real_size_model(torch.float32),
             "real-bf16": lambda: _real_size_model(torch.bfloat16)}[which]()
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
              for h, w in ((480, 640), (200, 90), (150, 150))]
    frames.append(Image.fromarray(frames[0]))       # a PIL image: a read-only array inside
    for frame in frames:
        monkeypatch.setattr(model, "crops_on_device", False)
        array, pil_x, tiling = model.image_crops(frame)
        monkeypatch.setattr(model, "crops_on_device", True)
        array2, torch_x, tiling2 = model.image_crops(frame)
        assert tiling2 == tiling and np.array_equal(array2, array)
        assert torch_x.dtype == pil_x.dtype == model.dtype
        assert torch.equal(torch_x, pil_x)


def test_resize_plans_by_size_bounded():
    """ResizePlans: None for an unchanged size, one plan per (in, out) size reused, the
    oldest dropped past `keep`, each plan giving PIL's pixels."""
    from photon_core.pil_resize import ResizePlans
    plans = ResizePlans("cpu", "bicubic", keep=2)
    assert plans.for_size(9, 9, 9, 9) is None and not len(plans.plans)
    a = plans.for_size(20, 30, 10, 15)
    assert plans.for_size(20, 30, 10, 15) is a
    plans.for_size(20, 30, 11, 15)
    plans.for_size(20, 30, 12, 15)
    assert list(plans.plans.values) == [(20, 30, 11, 15), (20, 30, 12, 15)]
    image = contents(20, 30)["random"]
    assert np.array_equal(a(torch.from_numpy(image)).numpy(),
                          pil_resize(image, 10, 15, "bicubic"))
