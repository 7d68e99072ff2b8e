"""Qwen 3.5 (0.8B-9B) as a photon_core model family (reference path).

Hybrid decoder (3 Gated DeltaNet : 1 gated full-attention layer), interleaved M-RoPE, a ViT
with 2x2 merging; skills through the chat template, detect/point via grounding JSON.
See photon_core/models/qwen3_5/*.py docstrings and ../../../docs for the engine API.
"""
from .config import MODEL_TYPES, ConfigError, Qwen35Config
from .checkpoint import CheckpointError
from .model import CAPABILITIES, EncodedImage, Qwen35Model, load_model
from .test_model import make_test_model

FAMILY = "qwen3.5"
FAST_PATH = True     # photon_core.fast serves it (models/qwen3_5/program.py, fast_family.py)
SKILLS = CAPABILITIES.skills     # query, caption, detect, point

__all__ = ["CAPABILITIES", "FAMILY", "MODEL_TYPES", "SKILLS", "CheckpointError", "ConfigError", "EncodedImage",
           "Qwen35Config", "Qwen35Model", "load_model", "make_test_model"]
