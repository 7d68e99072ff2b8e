"""photon_core: the perception engine (no ROS imports).

`load_model` imports torch on first use, so `import photon_core` stays light.
"""
from .task import Task, TaskError, TaskResult


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None, **kw):
    """Load Moondream 2 (reference path); see photon_core.moondream.model.load_model."""
    from .moondream.model import load_model as _load

    return _load(path_or_id, device=device, dtype=dtype, revision=revision, **kw)


__all__ = ["Task", "TaskError", "TaskResult", "load_model"]
