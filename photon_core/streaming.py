"""Incremental detokenization: emit text deltas that never cut a word.

Tokens collect in a buffer that is decoded as a whole each time. A delta is released up to
(and including) the last space; CJK characters are released at once; a trailing newline
releases everything and starts a new buffer. finish() releases the rest. The concatenated
deltas are the final text (the same chunking as the reference, so the same string).
"""
from __future__ import annotations

from typing import Callable


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x2F800 <= cp <= 0x2FA1F


class TextStreamer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.buffer: list[int] = []
        self.released = 0            # characters of decode(buffer) already emitted
        self.text = ""               # everything emitted so far

    def push(self, token: int) -> str:
        self.buffer.append(token)
        text = self.decode(self.buffer)
        if text.endswith("\n"):
            delta = text[self.released:]
            self.buffer, self.released = [], 0
        elif text and _is_cjk(text[-1]):
            delta = text[self.released:]
            self.released += len(delta)
        else:
            cut = text.rfind(" ", self.released)
            delta = text[self.released:cut + 1] if cut >= self.released else ""
            self.released += len(delta)
        self.text += delta
        return delta

    def pending(self) -> str:
        return self.decode(self.buffer)[self.released:] if self.buffer else ""

    def finish(self) -> str:
        delta = self.pending()
        self.buffer, self.released = [], 0
        self.text += delta
        return delta
