"""Moondream 2 (family "moondream2"), reference path: readable eager PyTorch (see
docs/architecture.md). Its decode step for the runtime's backends is `program.py`, its
coordinate phases `skill_protocol.py`."""
from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig
from .image_input import ImageError
from .model import CAPABILITIES, EncodedImage, MoondreamModel, build_random_model, load_model
from .run import TaskRun
from .test_model import make_test_model
from .weights import WeightsError

FAMILY = "moondream2"
# The fallback family (a config.json without model_type is Moondream 2's: our test
# checkpoints, the reference's dict form); the Hub repo's remote-code config says "moondream1".
MODEL_TYPES: tuple[str, ...] = ("moondream1",)
SKILLS = CAPABILITIES.skills           # detect, point, query, caption
FAST_PATH = True                       # photon_core.fast serves it (graphs, fused backend)

__all__ = ["CAPABILITIES", "FAMILY", "FAST_PATH", "MODEL_TYPES", "SKILLS", "MoondreamConfig", "TextConfig", "VisionConfig",
           "RegionConfig", "TokenizerConfig", "EncodedImage", "MoondreamModel", "TaskRun",
           "ImageError", "WeightsError", "build_random_model", "load_model", "make_test_model"]
