"""Where a bench's results go: $OUT (the device tool's folder that comes back), when set."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(name: str, obj) -> None:
    """obj as $OUT/name (indented JSON); nothing when OUT is not set."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], name).write_text(json.dumps(obj, indent=1))
