"""Moondream 2, reference path: readable eager PyTorch (see docs/architecture.md)."""
from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig
from .image_input import ImageError
from .model import EncodedImage, MoondreamModel, build_random_model, load_model
from .run import TaskRun
from .weights import WeightsError

__all__ = ["MoondreamConfig", "TextConfig", "VisionConfig", "RegionConfig", "TokenizerConfig",
           "EncodedImage", "MoondreamModel", "TaskRun", "ImageError", "WeightsError",
           "build_random_model", "load_model"]
