"""The FIFO baseline (what a chat engine does): the same scheduler loop with arrival-order
queueing and batching, no latest-frame superseding, no admission control, no deadline
cancelling and no preemption. Everything submitted is eventually answered, however late."""
from __future__ import annotations

from .edf_queue import FIFO
from .scheduler import Policy, Scheduler


def fifo_policy(max_batch: int = 4) -> Policy:
    return Policy(name="fifo", order=FIFO, supersede=False, admission=False,
                  cancel_on_miss=False, preempt=False, fair=False, max_batch=max_batch)


def fifo_scheduler(engine, cost_model=None, **kw) -> Scheduler:
    max_batch = kw.pop("max_batch", 4)
    return Scheduler(engine, cost_model, policy=fifo_policy(max_batch), **kw)
