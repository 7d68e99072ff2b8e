"""Encodes returned before the device ran them (engines declaring queued_encode,
engine.encodes_queued): their cost is read after the frame's tasks are started.

FastEngine.encode_image(image, sync=False) / encode_batch(images, sync=False) return once the
encode is queued on the engine's CUDA stream; each encoding carries gpu_timing and
`gpu_encode_ms()` (PrefixState: waits for the encode's end event, returns its share of the
call's device time). The call's host time is then only the queueing. The scheduler starts the
admitted tasks of the frame(s) right away (their prefills queue behind the encode on the same
stream, so the device does not idle while the host prepares them) and keeps a QueuedEncode;
it settles it (the device time read, the cost model and the frames' encode_ms updated) before
it decides on the next request, at the end of its admission round (before a decode step is
timed), or when a request of the frame ends (its Outcome carries the real encode cost).

FastEngine's graphed reference encoder (Qwen 3.5, Gemma 4) does the same for one image (no
encode_batch). An encoding without gpu_timing (the engine encoded synchronously: CPU, an
encode without a graph) is settled with the host time of the call, exactly as a synchronous encode
is measured (the scheduler measures those at once through the same record: _encode_call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class QueuedEncode:
    """One encode call (one frame, or a batch) not yet measured."""
    frames: list            # scheduler Frames, in the call's order
    encs: list              # their encodings
    host_ms: float          # the call's time on the scheduler's clock
    batched: bool = False   # an encode_batch call (the cost model learns it as one)

    def host_split(self) -> tuple[list[float], float]:
        """(per frame ms, call ms) from the host time, as a synchronous call is measured."""
        n = len(self.frames)
        return [self.host_ms / n] * n, self.host_ms

    def settle(self) -> tuple[list[float], float]:
        """(per frame ms, call ms): each encoding's device time (waits for the encode) when
        every encoding of the call was timed on the device, else host_split()."""
        if not all(getattr(e, "gpu_timing", None) is not None for e in self.encs):
            return self.host_split()
        per = [float(e.gpu_encode_ms()) for e in self.encs]
        return per, sum(per)


def setup_ms(encs: list[Any]) -> float:
    """One-time work inside the call (a graph capture): left out of the cost model."""
    return sum(getattr(e, "setup_ms", 0.0) or 0.0 for e in encs)
