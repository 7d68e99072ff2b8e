"""The per-frame perception logic shared by the live node and offline replay.

`PerceptionPipeline` knows the configuration (cameras, tasks, cadences) and the model. It
decides which tasks are due on a frame (`due_tasks`) and turns engine results into messages
(`message_for`). `process_frame` is the synchronous, deterministic path: encode the image
once, run every due task to the end, return the result messages in task order. The offline
replay tool calls exactly that; the live node submits the same due tasks to the deadline
scheduler instead and builds its messages with the same `message_for`.

No rclpy import here: only the generated message classes.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from photon_core.encode_request import EncodeRequest
from photon_core.scheduler.crop_ladder import LADDER, AdaptiveCrops
from photon_ros.result_messages import ResultTiming, build_result, stamp_to_s
from photon_ros.task_config import ADAPTIVE, PerceptionConfig, TaskConfig

# A source stamp this much older than the previous one of a camera counts as a clock jump
# backwards (bag loop, camera restart with a fresh clock): the camera's state is reset.
# Smaller reorderings are ordinary out-of-order frames (the scheduler supersedes them).
JUMP_BACK_S = 0.5


class Cadence:
    """When each task of a camera is due.

    every_n: frames whose index (per camera, from 0) is a multiple of N.
    hz: at most `hz` runs per second of *source stamps* (not wall time), so replaying a bag
    faster or slower gives the same frames; within 5% of the period counts as due.
    A stamp going backwards resets the camera's state (bag loop)."""

    def __init__(self):
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def reset(self, camera: str | None = None) -> None:
        with self._lock:
            if camera is None:
                self._last.clear()
            else:
                for k in [k for k in self._last if k[0] == camera]:
                    del self._last[k]

    def due(self, camera: str, tasks: tuple[TaskConfig, ...], frame_index: int,
            stamp_s: float) -> list[TaskConfig]:
        out = []
        with self._lock:
            for t in tasks:
                if t.hz > 0:
                    key = (camera, t.name)
                    last = self._last.get(key)
                    period = 1.0 / t.hz
                    if last is None or stamp_s < last or stamp_s - last >= period * 0.95:
                        self._last[key] = stamp_s
                        out.append(t)
                elif frame_index % max(1, t.every_n) == 0:
                    out.append(t)
        return out


class PerceptionPipeline:
    def __init__(self, config: PerceptionConfig, model: Any, model_id: str | None = None):
        self._config = config
        self.model = model
        self.model_id = model_id if model_id is not None else str(getattr(model, "model_id", ""))
        self.cadence = Cadence()
        self._lock = threading.Lock()

    # -- configuration -------------------------------------------------------------------
    @property
    def config(self) -> PerceptionConfig:
        return self._config

    def set_config(self, config: PerceptionConfig) -> None:
        """Swap the whole configuration at once (SetTasks, parameter updates)."""
        with self._lock:
            self._config = config
        self.cadence.reset()

    def tasks_of(self, camera: str) -> tuple[TaskConfig, ...]:
        return self._config.camera(camera).tasks

    # -- cadence ---------------------------------------------------------------------------
    def due_tasks(self, camera: str, frame_index: int, stamp_s: float) -> list[TaskConfig]:
        """The tasks of `camera` to run on its frame number `frame_index` (0-based) with
        source stamp `stamp_s` (seconds). Stateful for hz cadences: call once per frame."""
        try:
            tasks = self._config.camera(camera).tasks
        except KeyError:
            raise ValueError(f"unknown camera {camera!r}; configured: "
                             f"{', '.join(self._config.camera_names) or 'none'}") from None
        return self.cadence.due(camera, tasks, frame_index, stamp_s)

    def encode_input(self, camera: str, image: Any, adaptive: bool = False) -> Any:
        """The frame as the engine encodes it: for a family with crop modes (Moondream 2,
        photon_core.engine.Capabilities.crop_modes) an EncodeRequest carrying the camera's
        `crops`; for the others (whole-image encode) the bare image. A camera with crops
        "adaptive": with `adaptive` (a scheduler picks the mode: the live pipeline) an
        AdaptiveCrops, else the ladder's best mode (this synchronous path, offline replay)."""
        caps = self.model.capabilities if self.model is not None else None
        if caps is None or tuple(caps.crop_modes) == ("overlap",):
            return image
        try:
            crops = self._config.camera(camera).crops
        except KeyError:
            return image
        if crops == ADAPTIVE:
            if adaptive:
                return AdaptiveCrops(image, LADDER)
            crops = LADDER[0]
        return EncodeRequest(image, crops=crops) if caps.serves_crops(crops) else image

    # -- messages --------------------------------------------------------------------------
    def message_for(self, camera: str, task_name: str, result, header, width: int, height: int,
                    engine_ms: float | None = None, queue_ms: float = 0.0,
                    latency_ms: float = 0.0):
        """TaskResult -> DetectionArray | PointArray | Answer for this camera and task."""
        timing = ResultTiming(engine_ms=result.engine_ms if engine_ms is None else engine_ms,
                              queue_ms=queue_ms, latency_ms=latency_ms)
        return build_result(result, header, camera, task_name, self.model_id, width, height,
                            timing)

    # -- the synchronous path ------------------------------------------------------------------
    def process_frame(self, camera: str, header, image_rgb: np.ndarray, frame_index: int,
                      now_s: float | None = None) -> list:
        """Run every due task of `camera` on this frame, in configuration order, to the end
        (no deadlines: deterministic). Returns the result messages. latency_ms is
        `now_s` (seconds, same clock as the header stamp) minus the stamp, when given."""
        if not isinstance(image_rgb, np.ndarray) or image_rgb.ndim != 3 or image_rgb.shape[2] != 3:
            raise ValueError("image_rgb must be an HxWx3 uint8 numpy array")
        stamp_s = stamp_to_s(header.stamp)
        due = self.due_tasks(camera, frame_index, stamp_s)
        if not due:
            return []
        h, w = image_rgb.shape[:2]
        enc = self.model.encode_image(self.encode_input(camera, image_rgb))
        t0 = time.perf_counter()
        out = []
        for t in due:
            queue_ms = (time.perf_counter() - t0) * 1e3
            result = self.model.run(enc, t.to_task())
            latency = (now_s - stamp_s) * 1e3 if now_s is not None else 0.0
            out.append(self.message_for(camera, t.name, result, header, w, h,
                                        queue_ms=queue_ms, latency_ms=latency))
        return out
