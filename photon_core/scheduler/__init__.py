"""Deadline-aware low-concurrency scheduling for photon_core engines (pure Python).

    sched = Scheduler(model, CostModel.calibrate(model))       # or ThreadedScheduler(...)
    sched.submit_frame("front", stamp, image,
                       tasks=[("person", Task("detect", object="person"), 0.1, "cancel")],
                       kind="periodic", on_result=callback)       # -> Outcome per task
See docs/architecture.md, section Scheduler.
"""
from .admission import Load, fits, hopeless, project
from .clock import Clock, MonotonicClock, VirtualClock
from .cost_model import CostModel, TokenEstimator, moondream_crops
from .crop_ladder import AdaptiveCrops, CropLadder
from .edf_queue import EDF, FIFO, RequestQueue
from .engine import EngineLike, TaskRunLike, step_batch
from .fairness import FairShare
from .fifo import fifo_policy, fifo_scheduler
from .latest_frame import LatestFrameTable
from .request import (KINDS, ON_DEMAND, ON_MISS_CANCEL, ON_MISS_FINISH, PERIODIC, Frame, Outcome,
                      Status, TaskRequest, TaskSpec)
from .scheduler import MAX_BATCH_LIMIT, Policy, Scheduler
from .stream_health import StreamHealth, StreamHealthTracker
from .threaded import ThreadedScheduler

__all__ = [
    "Clock", "MonotonicClock", "VirtualClock", "CostModel", "TokenEstimator", "moondream_crops",
    "EDF", "FIFO", "RequestQueue", "EngineLike", "TaskRunLike", "step_batch", "fifo_policy",
    "fifo_scheduler", "LatestFrameTable", "KINDS", "ON_DEMAND", "ON_MISS_CANCEL", "ON_MISS_FINISH",
    "PERIODIC", "Frame", "Outcome", "Status", "TaskRequest", "TaskSpec", "MAX_BATCH_LIMIT",
    "Policy", "Scheduler", "ThreadedScheduler", "Load", "fits", "hopeless", "project",
    "FairShare", "StreamHealth", "StreamHealthTracker", "AdaptiveCrops", "CropLadder",
]
