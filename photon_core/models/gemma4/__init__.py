"""Gemma 4 (E2B, E4B) as a model family: reference engine for query and caption.

Files: config.py (config.json), weights.py (tensor names/shapes, sharded safetensors),
prompt.py (tokenizer.json + chat template), vision.py (preprocess + tower), text.py (decoder),
kv_cache.py, run.py (TaskRun), model.py (engine, load_model), test_model.py (tiny checkpoints).
"""
from .model import CAPABILITIES, SKILLS, Gemma4Model, load_model
from .test_model import make_test_model

FAMILY = "gemma4"
FAST_PATH = False    # served by its reference engine; the fast path does not serve it yet
MODEL_TYPES = ("gemma4",)

__all__ = ["CAPABILITIES", "FAMILY", "MODEL_TYPES", "SKILLS", "Gemma4Model", "load_model", "make_test_model"]
