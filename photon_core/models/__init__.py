"""Model families as plugins: the registry.

Each family is a package `photon_core/models/<family>/` exposing FAMILY, MODEL_TYPES, SKILLS,
CAPABILITIES (photon_core.engine.Capabilities: skills, crop modes, refusal message; its
reference engine's `capabilities`),
load_model(path_or_id, device, dtype, revision, **kw) -> its reference engine, and
make_test_model(out_dir, seed) (docs/architecture.md, "Adding a model family"), and
FAST_PATH: whether photon_core.fast serves it (False: the reference engine serves it on every
device; engine="fast" is refused with a clear error). The family of
a checkpoint is chosen by the `model_type` of its config.json; a checkpoint without one is
Moondream 2's (its config.json has no model_type); a model_type no family claims is an error.

Importing this package imports no family (and no torch); a family is imported when used.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType

# family packages under photon_core/models/, in lookup order; the fallback family last
PACKAGES = ("qwen3_5", "gemma4", "moondream2")
FALLBACK = "moondream2"


class UnknownModelType(ValueError):
    pass


def family_module(package: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{package}")


def families() -> dict[str, ModuleType]:
    """FAMILY name -> family package, for every registered family."""
    out = {}
    for p in PACKAGES:
        m = family_module(p)
        out[m.FAMILY] = m
    return out


def read_model_type(path_or_id: str, revision: str | None = None) -> str | None:
    """The `model_type` of a checkpoint's config.json (a local folder, or a Hugging Face repo
    id through huggingface_hub, honouring HF_HUB_OFFLINE); None when there is no config.json,
    it has no model_type, or it cannot be fetched (the family's loader then reports what is
    missing with its own clear error)."""
    p = Path(os.path.expanduser(str(path_or_id)))
    try:
        is_dir, exists = p.is_dir(), p.exists()
    except (OSError, ValueError):      # e.g. a name too long for the file system
        return None                    # the family's loader reports it with its own error
    cfg = p / "config.json" if is_dir else None
    if cfg is None and not exists and str(path_or_id).count("/") == 1 \
            and not str(path_or_id).startswith((".", "/", "~")):
        try:
            from huggingface_hub import hf_hub_download
            cfg = Path(hf_hub_download(str(path_or_id), "config.json", revision=revision))
        except Exception:  # noqa: BLE001 - offline, no config.json, unknown repo
            return None
    if cfg is None or not cfg.is_file():
        return None
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None       # the family loader reads it again and reports the error
    mt = d.get("model_type") if isinstance(d, dict) else None
    return mt if isinstance(mt, str) and mt else None


def family_for(model_type: str | None) -> ModuleType:
    """The family serving a config.json model_type (None: the fallback, Moondream 2)."""
    if model_type is None:
        return family_module(FALLBACK)
    for p in PACKAGES:
        m = family_module(p)
        if model_type in m.MODEL_TYPES:
            return m
    known = sorted({t for p in PACKAGES for t in family_module(p).MODEL_TYPES})
    raise UnknownModelType(f"no model family serves model_type {model_type!r} (known: "
                           f"{', '.join(known) or 'none'}; a config.json without model_type "
                           f"is Moondream 2)")


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision=None, **kw):
    """The family's reference engine for a checkpoint (family chosen from its config.json)."""
    fam = family_for(read_model_type(path_or_id, revision))
    return fam.load_model(path_or_id, device=device, dtype=dtype, revision=revision, **kw)


def capabilities(path_or_id: str, revision: str | None = None):
    """What the checkpoint's family serves (photon_core.engine.Capabilities: skills, crop
    modes, its refusal message), from its config.json without loading weights: for refusing
    tasks at configuration time. A Hugging Face id that cannot be read (offline) counts as the
    fallback family's; the loaded engine's `capabilities` is authoritative."""
    return family_for(read_model_type(path_or_id, revision)).CAPABILITIES


def has_fast_path(family: ModuleType) -> bool:
    """Whether photon_core.fast (the GPU fast path) serves this family."""
    return bool(getattr(family, "FAST_PATH", False))


__all__ = ["FALLBACK", "PACKAGES", "UnknownModelType", "capabilities", "families", "family_for",
           "family_module", "has_fast_path", "load_model", "read_model_type"]
