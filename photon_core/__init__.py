"""photon_core: the perception engine (no ROS imports).

`load_model` imports torch on first use, so `import photon_core` stays light.
"""
from .task import Task, TaskError, TaskResult


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None, **kw):
    """Load Moondream 2 (reference path); see photon_core.moondream.model.load_model."""
    from .moondream.model import load_model as _load

    return _load(path_or_id, device=device, dtype=dtype, revision=revision, **kw)


ENGINES = ("auto", "reference", "fast")


def load_engine(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None,
                engine: str = "auto", max_batch: int = 8, deterministic: bool = False, **kw):
    """Load a model and wrap it in the engine that serves it.

    engine: "reference" (eager PyTorch, any device), "fast" (photon_core.fast.FastEngine:
    static KV cache, CUDA graphs, pipelined decoding; on the CPU the same pipeline runs
    without graphs) or "auto" (fast on CUDA, reference elsewhere). Both expose the same API
    (encode_image, start, step_batch, run, model_id), so callers need not care which.
    deterministic: the fast path repeats its results bit for bit run to run (no split-K
    atomics; slightly slower); the reference path always does.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    model = load_model(path_or_id, device=device, dtype=dtype, revision=revision, **kw)
    if engine == "reference" or (engine == "auto" and model.device.type != "cuda"):
        return model
    from .fast import FastEngine

    return FastEngine(model, max_batch=max_batch, deterministic=deterministic)


__all__ = ["ENGINES", "Task", "TaskError", "TaskResult", "load_engine", "load_model"]
