"""The model as the scheduler sees it, plus per-request hooks the node needs.

The scheduler calls `engine.start(enc, task)` with the very Task object it was given, so a
request can carry extras keyed by that object: a streaming callback (text deltas for the
StreamAnswer action) and a cancel flag (the action's cancel). A cancelled run is stopped
between decode steps with finish_reason "cancelled"; the scheduler then delivers it like
any finished run. Everything else is forwarded to the model.

Forwarded explicitly: `capabilities` (the family's skills and crop modes,
photon_core.engine.Capabilities), `queued_encode` (the model's flag: encodes returned before
the device ran them, photon_core/scheduler/queued_encode.py), `encode_image` and, where the
model has it, `encode_batch` (several cameras' frames in one engine call,
photon_core/scheduler/encode_batch.py: an engine without it keeps encoding frame by frame, so
the adapter has the method only then), and where the model has it `crop_count` (a frame's
crops before it is encoded: the cost model's hint). Frames may be
photon_core.encode_request.EncodeRequests (a camera's crops mode): passed on untouched.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


class _HookedRun:
    def __init__(self, run: Any, cancelled: Callable[[], bool] | None):
        self.run = run
        self._cancelled = cancelled

    def cancel_requested(self) -> bool:
        return self._cancelled is not None and self._cancelled()

    def step(self) -> bool:
        if self.cancel_requested():
            self.run.cancel("cancelled")
            return False
        return self.run.step()

    def cancel(self, reason: str = "cancelled") -> None:
        self.run.cancel(reason)

    def result(self):
        return self.run.result()

    def __getattr__(self, name):
        return getattr(self.run, name)


class HookedEngine:
    """ignore_eos / step_delay_ms: test and benchmark hooks (see the node's debug_* params)."""

    def __init__(self, model: Any, ignore_eos: bool = False, step_delay_ms: float = 0.0):
        self.model = model
        self.ignore_eos = ignore_eos
        self.step_delay_s = max(0.0, step_delay_ms) / 1e3
        self._hooks: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.capabilities = model.capabilities
        self.encode_batches = 0                 # encode_batch calls forwarded (diagnostics)
        if callable(getattr(model, "encode_batch", None)):
            self.encode_batch = self._encode_batch
        # a frame's crop count before it is encoded (the cost model's hint), where the model
        # has one (photon_core/scheduler/engine.py crop_counter)
        if callable(getattr(model, "crop_count", None)):
            self.crop_count = model.crop_count
        # encodes the scheduler need not wait for (FastEngine: sync=False), only where the
        # model declares them (photon_core/scheduler/engine.py encodes_queued)
        self.queued_encode = getattr(model, "queued_encode", False) is True

    def hook(self, task, stream: Callable[[str], None] | None = None,
             cancelled: Callable[[], bool] | None = None) -> None:
        with self._lock:
            self._hooks[id(task)] = (task, stream, cancelled)

    def unhook(self, task) -> None:
        with self._lock:
            self._hooks.pop(id(task), None)

    def encode_image(self, image, **kw):
        """kw: sync=False where queued_encode (passed on; none otherwise)."""
        return self.model.encode_image(image, **kw)

    def _encode_batch(self, images: list, **kw) -> list:
        """The model's encode_batch (bound as `encode_batch` only where the model has one)."""
        self.encode_batches += 1
        return self.model.encode_batch(list(images), **kw)

    def _start(self, enc, task, stream=None):
        kw = {"ignore_eos": True} if self.ignore_eos else {}
        if stream is not None:
            kw["stream"] = stream
        return self.model.start(enc, task, **kw)

    def start(self, enc, task):
        with self._lock:
            hook = self._hooks.pop(id(task), None)
        if hook is None:
            return self._start(enc, task)
        _, stream, cancelled = hook
        if stream is None:
            return _HookedRun(self._start(enc, task), cancelled)
        holder: dict = {}

        def emit(delta: str) -> None:      # stream(delta, decode steps so far)
            run = holder.get("run")
            stream(delta, int(getattr(run, "steps", 0)) if run is not None else 0)

        run = self._start(enc, task, stream=emit)
        holder["run"] = run
        return _HookedRun(run, cancelled)

    def step_batch(self, runs: list) -> list[bool]:
        out: list[bool] = [False] * len(runs)
        inner, idx = [], []
        for i, r in enumerate(runs):
            if isinstance(r, _HookedRun):
                if r.cancel_requested():
                    r.run.cancel("cancelled")
                    continue
                inner.append(r.run)
            else:
                inner.append(r)
            idx.append(i)
        if inner:
            t0 = time.perf_counter()
            fn = getattr(self.model, "step_batch", None)
            alive = fn(inner) if fn is not None else [x.step() for x in inner]
            if alive is None:
                alive = [not getattr(x, "finished", False) for x in inner]
            if self.step_delay_s:
                left = self.step_delay_s - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
            for i, a in zip(idx, alive):
                out[i] = bool(a)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)
