"""Gemma 4 (E2B, E4B) as a model family: reference engine for query and caption.

Files: config.py (config.json), weights.py (tensor names/shapes, sharded safetensors),
prompt.py (tokenizer.json + chat template), vision.py (preprocess + tower), text.py (decoder),
kv_cache.py, run.py (TaskRun), model.py (engine, load_model), test_model.py (tiny checkpoints),
program.py (the decode step as a step program), fast_family.py (the runtime's view: FastEngine).
"""
from .model import CAPABILITIES, SKILLS, Gemma4Model, load_model
from .test_model import make_test_model

FAMILY = "gemma4"
FAST_PATH = True     # photon_core.fast serves it (models/gemma4/program.py, fast_family.py)
MODEL_TYPES = ("gemma4",)

__all__ = ["CAPABILITIES", "FAMILY", "FAST_PATH", "MODEL_TYPES", "SKILLS", "Gemma4Model", "load_model", "make_test_model"]
