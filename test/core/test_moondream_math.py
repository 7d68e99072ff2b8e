"""Pure functions: tiling, stitching, region encode/decode, sampling, streaming."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from photon_core.moondream import region
from photon_core.moondream.crops import overlap_crops, select_tiling, stitch_features
from photon_core.ops.sampling import sample, top_p_filter
from photon_core.moondream.streaming import TextStreamer


def real_tiling(width, height):
    return select_tiling(height - 112, width - 112, 266, 12)


@pytest.mark.parametrize("wh,expected", [
    ((640, 480), (2, 4)), ((378, 378), (1, 1)), ((1920, 1080), (2, 4)), ((3000, 200), (1, 1)),
    ((1000, 1000), (3, 3)), ((800, 600), (2, 4)), ((600, 1200), (5, 2)), ((379, 2000), (6, 1)),
])
def test_select_tiling_rules(wh, expected):
    assert real_tiling(*wh) == expected


def test_tiling_never_exceeds_max_crops():
    for h in range(1, 5000, 97):
        for w in range(1, 5000, 89):
            r, c = select_tiling(h, w, 266, 12)
            assert 1 <= r and 1 <= c and r * c <= 12


def test_640x480_gives_9_crops():
    img = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    crops, tiling = overlap_crops(img, 378, 14, 4, 12)
    assert tiling == (2, 4) and crops.shape == (9, 378, 378, 3)
    # neighbouring local crops overlap by 2 margins (112 px) of the resized image
    assert np.array_equal(crops[1][:, 266:], crops[2][:, :112])
    assert np.array_equal(crops[1][266:, :], crops[5][:112, :])


def test_stitch_keeps_centres_and_outer_margins():
    g, m, tiling = 6, 1, (2, 3)
    local = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1).expand(6, g, g, 1)
    out = stitch_features(local, tiling, m)
    assert out.shape == ((g - 2 * m) * 2 + 2 * m, (g - 2 * m) * 3 + 2 * m, 1)
    grid = out[..., 0]
    assert grid[0, 0] == 0 and grid[-1, -1] == 5 and grid[0, -1] == 2 and grid[-1, 0] == 3
    # the boundary between crop 0 and crop 1 lies after crop 0's window: x = m + (g - 2m)
    assert grid[2, m + (g - 2 * m) - 1] == 0 and grid[2, m + (g - 2 * m)] == 1


def test_size_bins_round_trip():
    for b in range(1024):
        assert region.size_to_bin(region.bin_to_size(b)) == b
    for s in (1 / 1024, 0.01, 0.1, 0.37, 0.5, 1.0):
        back = region.bin_to_size(region.size_to_bin(s))
        assert abs(math.log2(back) - math.log2(s)) <= 10 / 1023 / 2 + 1e-9
    assert region.bin_to_size(1023) == 1.0 and region.bin_to_size(0) == 2 ** -10


def test_sizes_are_float32_values_like_the_reference():
    """The reference computes 2 ** (bin / 1023 * 10 - 10) in float32 torch arithmetic on the
    argmax; a float64 formula differs in the last bits for 1022 of the 1024 bins, so boxes
    were not bit-identical to the reference's."""
    for b in range(1024):
        expected = torch.pow(2.0, (torch.tensor(b).float() / 1023.0) * 10.0 - 10.0).item()
        assert region.bin_to_size(b) == expected, b
    for b in range(1024):
        assert region.bin_to_coordinate(b, 1024) == (torch.tensor(b) / 1024).item()


def test_decoded_box_is_center_plus_minus_half_float32_size(fast_model, image):
    from photon_core.task import Task

    w = fast_model.weights
    run = fast_model.start(image, Task("detect", object="person", max_objects=1),
                           ignore_eos=True)
    with torch.inference_mode():
        x = region.coordinate_logits(w, run.hidden).argmax().item() / 1024
        run.step()
        y = region.coordinate_logits(w, run.hidden).argmax().item() / 1024
        run.step()
        bins = region.size_logits(w, run.hidden).argmax(-1)
        run.step()
    sw, sh = (torch.pow(2.0, (b.float() / 1023.0) * 10.0 - 10.0).item() for b in bins)
    assert run.result().output["objects"] == [{"x_min": x - sw / 2, "y_min": y - sh / 2,
                                               "x_max": x + sw / 2, "y_max": y + sh / 2}]


def test_pixel_normalization_rounds_like_the_reference_in_each_dtype():
    """uint8 -> dtype, then /255, -0.5, /0.5 each rounded to dtype (the reference's order).
    Computing in fp32 and rounding once gave different bf16 values for many pixel values."""
    from photon_core.moondream.vision import normalize

    px = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        expected = torch.from_numpy(px).permute(0, 3, 1, 2).to(dtype).div(255.0).sub(0.5).div(0.5)
        got = normalize(px, "cpu", dtype)
        assert got.dtype == dtype and torch.equal(got, expected), dtype


def test_top_p_filter_runs_at_top_p_one_like_the_reference(monkeypatch):
    from photon_core.ops import sampling

    calls = []
    real = sampling.top_p_filter
    monkeypatch.setattr(sampling, "top_p_filter", lambda p, t: calls.append(t) or real(p, t))
    sampling.sample(torch.tensor([0.1, 2.0, 1.9]), 1.0, 1.0, torch.Generator().manual_seed(0))
    assert calls == [1.0]


def test_coordinate_bins_round_trip():
    for b in range(1024):
        assert region.coordinate_to_bin(region.bin_to_coordinate(b, 1024), 1024) == b
    assert region.coordinate_to_bin(1.0, 1024) == 1023


def test_region_encoders_are_fourier_of_value(fast_model):
    w = fast_model.weights
    a, b = region.encode_coordinate(w, 0.25), region.encode_coordinate(w, 0.75)
    assert a.shape == (1, 1, fast_model.config.text.dim) and not torch.allclose(a, b)
    f = w["region.coord_features"]
    feats = torch.cat([torch.cos(2 * math.pi * 0.25 * f), torch.sin(2 * math.pi * 0.25 * f)], -1)
    torch.testing.assert_close(a.view(-1), w.linear(feats, "region.coord_encoder").view(-1))


def test_top_p_keeps_smallest_nucleus():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.equal(top_p_filter(p, 0.7) > 0, torch.tensor([True, True, False, False]))
    assert torch.equal(top_p_filter(p, 0.4) > 0, torch.tensor([True, False, False, False]))
    torch.testing.assert_close(top_p_filter(p, 1.0), p)


def test_sampling_greedy_and_seeded():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert sample(logits, 0.0, 1.0) == 1
    draws = lambda seed: [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(seed))
                          for _ in range(1)]
    assert draws(5) == draws(5)
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, 0.4, g) for _ in range(50)} == {1}   # nucleus = top token


def test_streamer_cuts_at_spaces_and_flushes():
    pieces = {1: "Hello", 2: " wor", 3: "ld", 4: "!\n", 5: " ok"}
    s = TextStreamer(lambda ids: "".join(pieces[i] for i in ids))
    deltas = [s.push(i) for i in (1, 2, 3, 4, 5)] + [s.finish()]
    assert deltas == ["", "Hello ", "", "world!\n", " ", "ok"]
    assert "".join(deltas) == s.text == "Hello world!\n ok"
