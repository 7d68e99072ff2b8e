"""Progress bars for long replays and plays (tqdm on stderr; None when off or unavailable)."""
from __future__ import annotations

import sys


def progress_bar(total: int, enabled: bool, desc: str, unit: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
