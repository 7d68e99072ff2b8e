"""Old import path of the Moondream 2 family, now photon_core.models.moondream2.

`photon_core.moondream.<module>` is the very module object `photon_core.models.moondream2.<module>`
(so monkeypatching either name patches both); new code imports photon_core.models.moondream2.
"""
import importlib
import sys

from ..models import moondream2 as _family
from ..models.moondream2 import *  # noqa: F401,F403

_MODULES = ("config", "crops", "hub", "image_input", "kv_cache", "layers",
            "model", "region", "rope", "run", "sampling", "streaming", "test_model", "text",
            "tokenizer", "vision", "weights")
for _name in _MODULES:
    _mod = importlib.import_module(f"{_family.__name__}.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod
__all__ = list(_family.__all__)
