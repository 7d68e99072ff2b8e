"""`photon make-test-model moondream2 --real-shapes`: random weights in Moondream 2's real shapes
(bf16, the real tensor names), for GPU soaks and benchmarks. The 1.9 B-parameter model itself is
only written on the GPU machine; here the same code path runs with a small config, and the
real-shape option is checked for its config, its routing through the CLI and its errors."""
from __future__ import annotations

import json

import pytest
import torch

from photon_core.models.moondream2.config import (MoondreamConfig, RegionConfig, TextConfig,
                                                  TokenizerConfig, VisionConfig)
from photon_core.models.moondream2.test_model import (build_test_tokenizer, make_test_model,
                                                      test_templates as templates_of)
from photon_core.models.moondream2.weights import TEST_MODEL_KEY, expected_shapes


def small_config() -> MoondreamConfig:
    """Small, but not the tiny test config: 2 vision layers, 96-dim text (3 heads)."""
    dim = 96
    return MoondreamConfig(
        text=TextConfig(dim=dim, ff_dim=192, n_layers=2, vocab_size=700, max_context=256,
                        n_heads=3, n_kv_heads=3, prefix_attn=37),
        vision=VisionConfig(enc_dim=32, enc_n_layers=2, enc_ff_dim=64, enc_n_heads=2,
                            crop_size=84, overlap_margin=1, max_crops=4, proj_inner_dim=64,
                            proj_out_dim=dim),
        region=RegionConfig(dim=dim, coord_feat_dim=32, size_feat_dim=32, inner_dim=64),
        tokenizer=TokenizerConfig(templates=templates_of(build_test_tokenizer())))


def test_config_path_writes_the_layout_loads_and_runs(tmp_path):
    from safetensors import safe_open

    from photon_core import load_engine
    from photon_core.task import Task

    cfg = small_config()
    d = make_test_model(tmp_path / "m", seed=3, dtype=torch.bfloat16, config=cfg)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        dtypes = {f.get_slice(n).get_dtype() for n in names}
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    want = {"model." + k: v for k, v in expected_shapes(cfg).items()}
    assert shapes == want                       # every tensor, in the real names and shapes
    assert dtypes == {"BF16"}
    assert "random" in meta[TEST_MODEL_KEY]
    assert MoondreamConfig.from_file(d / "config.json") == cfg
    modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir()}
    assert len(set(modes.values())) == 1, modes
    eng = load_engine(str(d), device="cpu", dtype="fp32", engine="reference")
    res = eng.run(eng.encode_image(torch.zeros(60, 80, 3, dtype=torch.uint8).numpy()),
                  Task("detect", object="person", max_objects=2))
    assert res.finish_reason in ("stop", "length")
    assert all(0.0 <= o[k] <= 1.0 for o in res.output["objects"] for k in o)


def test_real_shapes_are_moondream2s_defaults(monkeypatch, tmp_path):
    """real_shapes=True asks for MoondreamConfig() in bf16 with no eos bias; the weights
    generator is replaced so that nothing of 1.9 B parameters is made here."""
    import photon_core.models.moondream2.weights as weights

    seen = {}

    def fake_random_weights(cfg, device="cpu", dtype=torch.float32, seed=0, eos_bias=0.0):
        seen.update(cfg=cfg, device=device, dtype=dtype, seed=seed, eos_bias=eos_bias)
        return {"text.lm_head.bias": torch.zeros(4, dtype=dtype)}

    monkeypatch.setattr(weights, "random_weights", fake_random_weights)
    d = make_test_model(tmp_path / "r", seed=5, real_shapes=True)
    assert seen["cfg"] == MoondreamConfig()
    assert seen["dtype"] == torch.bfloat16 and seen["eos_bias"] == 0.0 and seen["seed"] == 5
    n = sum(torch.Size(s).numel() for s in expected_shapes(MoondreamConfig()).values())
    assert 1.8e9 < n < 2.0e9                    # the real model's size (3.85 GB in bf16)
    assert json.loads((d / "config.json").read_text())["text"]["dim"] == 2048
    with pytest.raises(ValueError):
        make_test_model(tmp_path / "x", real_shapes=True, fast=True)


def test_cli_routes_real_shapes(monkeypatch, tmp_path, capsys):
    from photon_core import cli
    from photon_core.models import families

    fam = families()["moondream2"]
    calls = []
    monkeypatch.setattr(fam, "make_test_model",
                        lambda out, seed=0, **kw: calls.append((out, seed, kw)) or tmp_path)
    assert cli.main(["make-test-model", "moondream2", str(tmp_path / "m"), "--real-shapes"]) == 0
    assert calls[-1][2]["real_shapes"] is True and str(calls[-1][2]["device"]) == "cpu"
    assert cli.main(["make-test-model", "moondream2", str(tmp_path / "m")]) == 0
    assert "real_shapes" not in calls[-1][2]
    assert cli.main(["make-test-model", "moondream2", str(tmp_path / "m"), "--real-shapes",
                     "--device", "potato"]) == 2
    assert "unknown device 'potato'" in capsys.readouterr().err
    assert cli.main(["make-test-model", "qwen3.5", str(tmp_path / "q"), "--real-shapes"]) == 2
