"""Grounding JSON -> the Moondream-shaped outputs (shared by the Qwen 3.5 and Gemma 4 families).

The models answer detect/point prompts with text such as
    ```json
    [{"bbox_2d": [x1, y1, x2, y2], "label": "cup"}, {"point_2d": [x, y], "label": "cup"}]
    ```
with coordinates on a 0..1000 grid. parse_grounding turns that into
    detect: [{"x_min", "y_min", "x_max", "y_max"}]    point: [{"x", "y"}]
normalized to 0..1 (clamped; box corners put in order). It never raises: text that is not
valid JSON gives an empty result and an `error` string, which callers count; with
salvage=True (the engine sets it when the answer was cut off by its token budget) the complete
objects before the cut are kept, the error still set. Entries without a usable
bbox_2d / point_2d (wrong length, non-numbers, NaN) are skipped and counted in `skipped`.
A point prompt answered with boxes gives the boxes' centres; a detect prompt answered with
points gives nothing for those entries (skipped). A salvaged answer that still holds
max_objects objects is no error: the cut came after the objects asked for.

EntryCap counts an answer's complete, usable entries as its tokens arrive, so an engine can
end a detect / point task at its max_objects-th entry (finish reason "length") instead of
decoding on to its token budget, as Moondream 2's region tasks end at their last object.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

SCALE = 1000.0
_FENCE = re.compile(r"```(?:json)?\s*(.*?)(?:```|$)", re.S)


@dataclass
class GroundingResult:
    objects: list[dict] = field(default_factory=list)
    error: str | None = None       # set when the text was not one valid JSON value
    skipped: int = 0               # entries without usable coordinates


def _numbers(value, n: int) -> list[float] | None:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        return None
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        out.append(min(1.0, max(0.0, float(v) / SCALE)))
    return out


def _entries(value) -> list:
    """The candidate objects of a parsed JSON value (list, single object, or {"objects": [...]})."""
    if isinstance(value, list):
        out = []
        for v in value:
            out.extend(_entries(v) if isinstance(v, list) else [v])
        return out
    if isinstance(value, dict):
        for key in ("objects", "boxes", "points", "result", "results"):
            if isinstance(value.get(key), list) and not ("bbox_2d" in value or "point_2d" in value):
                return _entries(value[key])
        return [value]
    return []


def _convert(entry, skill: str) -> dict | None:
    if not isinstance(entry, dict):
        return None
    box = _numbers(entry.get("bbox_2d"), 4)
    if skill == "detect":
        if box is None:
            return None
        x0, y0, x1, y1 = box
        return {"x_min": min(x0, x1), "y_min": min(y0, y1), "x_max": max(x0, x1),
                "y_max": max(y0, y1)}
    pt = _numbers(entry.get("point_2d"), 2)
    if pt is not None:
        return {"x": pt[0], "y": pt[1]}
    if box is not None:
        return {"x": (box[0] + box[2]) / 2, "y": (box[1] + box[3]) / 2}
    return None


def _salvage(text: str) -> list:
    """Every complete JSON object found in text (for truncated or otherwise broken answers)."""
    dec = json.JSONDecoder()
    found, i = [], text.find("{")
    while i != -1:
        try:
            value, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        i = text.find("{", end)
    return found


def extract_json_text(text: str) -> str:
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip()


def parse_grounding(text: str, skill: str, max_objects: int | None = None,
                    salvage: bool = False) -> GroundingResult:
    """text -> GroundingResult for skill "detect" or "point". Never raises."""
    if skill not in ("detect", "point"):
        raise ValueError(f"grounding is for detect/point, not {skill!r}")  # caller bug, not input
    res = GroundingResult()
    try:
        body = extract_json_text(text if isinstance(text, str) else str(text))
        try:
            entries = _entries(json.loads(body))
        except (ValueError, RecursionError):
            res.error = "answer is not valid JSON" if body else "empty answer"
            entries = _entries(_salvage(body)) if salvage else []
        for entry in entries:
            obj = _convert(entry, skill)
            if obj is None:
                res.skipped += 1
            elif max_objects is None or len(res.objects) < max_objects:
                res.objects.append(obj)
        if salvage and res.error and max_objects is not None and \
                len(res.objects) >= max_objects:
            res.error = None     # cut after the objects asked for (EntryCap), not malformed
    except Exception as e:   # belt and braces: bad model output must never crash a task
        res.objects, res.error = [], f"grounding parse failed: {type(e).__name__}: {e}"
    return res


class EntryCap:
    """A grounding answer's complete, usable entries, counted as its text arrives piece by
    piece: feed(piece) is True from the piece that completes the max_objects-th.

    An entry is a JSON object opened at the nesting depth of the answer's first "{" (the
    list's items in [{...}, {...}]) that _convert turns into an object of the skill - what
    parse_grounding's salvage keeps from the text cut there. Brackets and braces inside
    strings do not count. Text it cannot follow (a wrapper object, a stray quote) is never
    counted: the task then runs to its token budget, as without the cap."""

    def __init__(self, skill: str, max_objects: int):
        self.skill, self.max_objects = skill, max_objects
        self.depth, self.base, self.count = 0, None, 0
        self.in_str = self.escaped = False
        self.entry: list[str] | None = None     # the open entry's text from its "{"

    def feed(self, piece: str) -> bool:
        for ch in piece:
            if self.entry is not None:
                self.entry.append(ch)
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "[{":
                if ch == "{" and self.entry is None and self.base in (None, self.depth):
                    self.base, self.entry = self.depth, ["{"]
                self.depth += 1
            elif ch in "]}":
                self.depth = max(0, self.depth - 1)
                if ch == "}" and self.entry is not None and self.depth == self.base:
                    self._close("".join(self.entry))
                    self.entry = None
        return self.count >= self.max_objects

    def _close(self, text: str) -> None:
        try:
            obj = _convert(json.loads(text), self.skill)
        except (ValueError, RecursionError):
            obj = None
        self.count += obj is not None


def token_cap(skill: str, max_objects: int,
              decode: Callable[[list[int]], str]) -> Callable[[int], bool]:
    """An engine's per-token check: feed(token) is EntryCap.feed of that token's text
    (decode([token]): a byte-level token's ASCII brackets, braces and quotes come through
    whole)."""
    cap = EntryCap(skill, max_objects)
    return lambda token: cap.feed(decode([token]))
