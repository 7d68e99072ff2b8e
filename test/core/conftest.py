"""Shared fixtures for the core tests: tiny random Moondream checkpoints (written once)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def fast_dir(tmp_path_factory):
    """A tiny checkpoint with the small (fast) vision tower."""
    from photon_core.moondream.test_model import make_test_model

    return make_test_model(tmp_path_factory.mktemp("md_fast"), seed=1, fast=True)


@pytest.fixture(scope="session")
def fast_model(fast_dir):
    from photon_core.moondream import load_model

    return load_model(str(fast_dir), progress=False)


@pytest.fixture
def image():
    return np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)


@pytest.fixture
def images():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for h, w in ((120, 160), (200, 90), (64, 64), (150, 150))]
