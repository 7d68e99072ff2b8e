"""The node's live pipeline on the GPU fast path (skipped without CUDA): the encode graphs of
every configured camera size and crop mode are captured at build (activation) time, so the
cameras' first frames capture nothing; frames of a global-crop camera are encoded with one
crop, through encode_batch of the adapter."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prepare_encode_at_activation_and_global_crops_on_the_fast_path():
    from photon_core import EngineOptions
    from photon_core.fast import FastEngine
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
    from photon_ros.live_pipeline import build_live_pipeline
    from photon_ros.task_config import config_from_params

    m = build_random_model(tiny_config(fast=True), device="cuda", dtype="bf16", seed=0,
                           eos_bias=TEST_EOS_BIAS["fast"])
    fe = FastEngine(m, options=EngineOptions(max_batch=4))
    task = {"skill": "detect", "object": "person", "max_objects": 2, "deadline_ms": 30000.0}
    # two global-crop cameras of one size: prepared for 1 and 2 frames of that layout
    # (prepare_encode prepares k frames of one layout; a batch mixing crop modes is a layout
    # of its own, captured on second sight)
    cfg = config_from_params({
        "max_batch": 4, "cameras": ["fast", "full"],
        "fast": {"topic": "/fast", "crops": "global", "width": 160, "height": 120,
                 "tasks": ["people"], "people": task},
        "full": {"topic": "/full", "crops": "global", "width": 160, "height": 120,
                 "tasks": ["people"], "people": task}})
    outcomes = []
    live = build_live_pipeline(cfg, fe, threaded=False, calibrate=False,
                               on_result=outcomes.append)
    captured = fe.batch_encoder.counts["captures"]
    assert captured >= 2                      # the global layout: 1 and 2 frames
    rng = np.random.default_rng(0)
    for i in range(3):
        for cam in ("fast", "full"):
            ticket = live.accept(cam, 1.0 + i)
            live.submit(cam, ticket, rng.integers(0, 256, (120, 160, 3), dtype=np.uint8),
                        arrival=live.scheduler.clock.now())
        live.scheduler.run_until_idle()
    assert len(outcomes) == 6 and all(str(o.status) == "done" for o in outcomes), \
        [(o.stream, str(o.status), o.error) for o in outcomes]
    assert fe.batch_encoder.counts["captures"] == captured, "a capture fell into live traffic"
    enc = fe.encode_image(live.encode_input("fast", np.zeros((120, 160, 3), np.uint8)))
    assert enc.n_crops == 1 and enc.crops == "global"
    live.stop()
    fe.close()
