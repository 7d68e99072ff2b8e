"""Batched encode across cameras: the frames of several requests admitted in one round
(different cameras, or different frames of one camera) encoded in one engine call.

Engine side (optional, like step_batch): `engine.encode_batch(images) -> list[encoding]`,
one encoding per image, in order, each usable exactly like encode_image's. An engine
without it encodes one frame at a time and nothing here changes its behaviour.

Scheduler side: when a request is admitted and its frame is not encoded yet, the scheduler
looks down the queue (same order) for more requests whose frames are not encoded, and adds
each to the group while admission control says the whole group (one batched encode, then
every prefill, then the decode batches to come) and everything already running still meet
their deadlines, up to the batch limit. The cost model predicts a batched encode as
`encode_batch_factor[n]` x the frames one by one (learned online from the engine's calls;
1.0, no gain, until measured), so a batched encode is only planned where it fits.
"""
from __future__ import annotations

from typing import Any


def has_encode_batch(engine: Any) -> bool:
    return callable(getattr(engine, "encode_batch", None))


def encode_batch(engine: Any, images: list, sync: bool = True) -> list:
    """One engine call for all `images` (engine.encode_batch), checked: one encoding each.
    sync=False (only for an engine declaring queued_encode, engine.encodes_queued) is passed
    on: the call may return once the encode is queued (queued_encode.py)."""
    out = list(engine.encode_batch(list(images)) if sync
               else engine.encode_batch(list(images), sync=False))
    if len(out) != len(images):
        raise RuntimeError(f"encode_batch returned {len(out)} encodings for {len(images)} images")
    return out
