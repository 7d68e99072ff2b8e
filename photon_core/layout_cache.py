"""Per-layout values of an image encode (resize plans, patch positions, position tables...),
made on first use and kept: a camera's frames share them. At most `keep` are kept - the
oldest is dropped - so a stream of ever-new frame sizes cannot grow memory (a captured
encode graph that uses a dropped value holds its own reference to it)."""
from __future__ import annotations

from typing import Callable, Hashable


class LayoutCache:
    def __init__(self, keep: int = 32):
        self.keep = keep
        self.values: dict = {}

    def get(self, key: Hashable, make: Callable):
        """The value of `key`, made by make() on first use."""
        v = self.values.get(key)
        if v is None:
            if len(self.values) >= self.keep:
                del self.values[next(iter(self.values))]
            v = self.values[key] = make()
        return v

    def __len__(self) -> int:
        return len(self.values)
