"""photon_core: the perception engine (no ROS imports).

`load_model` imports torch on first use, so `import photon_core` stays light.
"""
from .engine import ENGINES, Engine, EngineOptions, PrefixState, Run
from .task import Task, TaskError, TaskResult


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None, **kw):
    """The reference engine of a checkpoint's model family (photon_core.models: the family is
    chosen from its config.json's model_type; Moondream 2 without one)."""
    from .models import load_model as _load

    return _load(path_or_id, device=device, dtype=dtype, revision=revision, **kw)


def load_engine(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None,
                engine: str | None = None, max_batch: int | None = None,
                deterministic: bool | None = None, options: EngineOptions | None = None,
                **kw):
    """Load a model and wrap it in the engine that serves it.

    options (photon_core.engine.EngineOptions): engine "reference" (the family's eager
    PyTorch engine, any device), "fast" (photon_core.fast.FastEngine: state cache, CUDA
    graphs, pipelined decoding; on the CPU the same pipeline runs without graphs) or "auto"
    (fast on CUDA, reference elsewhere); the fast path's backend (fused), attention, crops
    on device, deterministic, max_batch. The keywords engine / max_batch / deterministic
    override the options' fields. Every engine exposes the same API (photon_core.engine.Engine).
    deterministic: the fast path repeats its results bit for bit run to run (no split-K
    atomics; slightly slower); the reference path always does.
    """
    options = (options or EngineOptions()).with_(engine=engine, max_batch=max_batch,
                                                 deterministic=deterministic)
    from .models import family_for, has_fast_path, read_model_type

    family = family_for(read_model_type(path_or_id, revision))
    if options.engine == "fast" and not has_fast_path(family):
        raise ValueError(f"engine 'fast' does not serve the {family.FAMILY} family yet; use "
                         "engine 'auto' or 'reference' (its reference engine)")
    model = family.load_model(path_or_id, device=device, dtype=dtype, revision=revision, **kw)
    if options.crops_on_device is not None and hasattr(model, "crops_on_device"):
        model.crops_on_device = options.crops_on_device
    if hasattr(model, "crops"):           # the default crop mode (EngineOptions.crops)
        model.crops = options.crops
    if options.engine == "reference" or (options.engine == "auto" and (
            model.device.type != "cuda" or not has_fast_path(family))):
        return model
    from .fast import FastEngine

    return FastEngine(model, options=options)


__all__ = ["ENGINES", "Engine", "EngineOptions", "PrefixState", "Run", "Task", "TaskError",
           "TaskResult", "load_engine", "load_model"]
