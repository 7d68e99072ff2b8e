"""Finding a checkpoint's files: a local folder, or a Hugging Face repo id (+ revision).

Only model.safetensors, tokenizer.json and (optional) config.json are fetched, through
huggingface_hub, which honours HF_HUB_OFFLINE (then only the local cache is used). Nothing
executable is ever loaded. From the Hub, the tokenizer always comes from Moondream 2's
tokenizer repo (moondream/starmie-v1), as in the reference implementation: the prompt
templates (special ids 0-9) belong to that tokenizer, while a model repo may still carry an
older tokenizer.json from before it. A local folder brings its own tokenizer.json.
"""
from __future__ import annotations

import os
from pathlib import Path

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CONFIG = "config.json"
TOKENIZER_REPO = "moondream/starmie-v1"


class CheckpointNotFound(ValueError):
    pass


def resolve(path_or_id: str, revision: str | None = None) -> dict[str, Path | None]:
    """-> {"weights": path, "tokenizer": path, "config": path or None}."""
    if not isinstance(path_or_id, (str, os.PathLike)) or not str(path_or_id).strip() \
            or len(str(path_or_id)) > 4096 or "\x00" in str(path_or_id):
        raise CheckpointNotFound(f"model {str(path_or_id)[:80]!r} is not a folder path or a "
                                 "Hugging Face repo id")
    p = Path(os.path.expanduser(str(path_or_id)))
    if p.is_dir():
        files = {"weights": p / WEIGHTS, "tokenizer": p / TOKENIZER, "config": p / CONFIG}
        for key in ("weights", "tokenizer"):
            if not files[key].is_file():
                raise CheckpointNotFound(f"{files[key]} not found (a model folder needs "
                                         f"{WEIGHTS} and {TOKENIZER})")
        if not files["config"].is_file():
            files["config"] = None
        return files
    if p.suffix in (".bin", ".pt", ".pth", ".ckpt"):
        raise CheckpointNotFound(f"{p}: only safetensors checkpoints are loaded (no pickle)")
    if p.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise CheckpointNotFound(f"model folder {path_or_id!r} not found (and it is not a "
                                 "Hugging Face repo id like 'vikhyatk/moondream2')")
    return _from_hub(str(path_or_id), revision)


def _from_hub(repo_id: str, revision: str | None) -> dict[str, Path | None]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def get(repo, name, required=True, rev=revision):
        try:
            return Path(hf_hub_download(repo, name, revision=rev))
        except LocalEntryNotFoundError as e:   # offline (or no network) and not cached
            if not required:                   # optional (config.json): defaults apply
                return None
            raise CheckpointNotFound(
                f"cannot get {name} of Hugging Face repo {repo}@{rev or 'main'}: not in the "
                f"local cache and the Hub cannot be reached (HF_HUB_OFFLINE="
                f"{os.environ.get('HF_HUB_OFFLINE', 'unset')}): {e}") from None
        except EntryNotFoundError:
            if required:
                raise CheckpointNotFound(f"{repo}@{rev or 'main'} has no {name}") from None
            return None
        except Exception as e:  # offline without cache, unknown repo, network errors
            if not required and "404" in str(e):
                return None
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            hint = " (HF_HUB_OFFLINE is set and the file is not in the local cache)" if offline else ""
            raise CheckpointNotFound(f"cannot get {name} from Hugging Face repo {repo}"
                                     f"@{rev or 'main'}{hint}: {type(e).__name__}: {e}") from None

    return {"weights": get(repo_id, WEIGHTS), "config": get(repo_id, CONFIG, required=False),
            "tokenizer": get(TOKENIZER_REPO, TOKENIZER, rev=None)}
