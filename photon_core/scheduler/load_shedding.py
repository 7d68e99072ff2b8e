"""Load shedding after an engine failure in a batch (GPU out of memory; issue 17).

When `engine.step_batch` raises at batch b > 1, or `engine.start` / `encode_image` raises
while other runs hold engine memory, the scheduler does not fail the requests involved:
the engine is assumed to have run out of room (torch.cuda.OutOfMemoryError; any exception
is treated the same, since a batch is the likely cause). The batch limit drops to b // 2 (a
start failure: to the runs still open) for `hold_s`; the runs of the failed step stay open
and are stepped again in smaller batches (those beyond the limit are preempted, state
kept), a request whose start failed goes back to the queue. Each clean `hold_s` raises the
limit again (doubling, up to the policy's max_batch). A failure at batch 1, or a request
whose start failed `max_start_failures` times, ends ERROR: nothing smaller to retry with.
So an exception caused by one bad request ends only that request: the batch is halved until
the culprit steps alone.

Engine contract this needs (documented in docs/architecture.md): a `step_batch` that raises
leaves its runs as they were before the call (not advanced, still usable) or marks them
finished; `start` that raises leaves nothing open.
"""
from __future__ import annotations

from dataclasses import dataclass


def is_out_of_memory(e: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError (without importing torch) or a message saying so."""
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


@dataclass
class BatchLimiter:
    max_batch: int
    hold_s: float = 5.0           # a lowered limit holds this long before it is raised again
    max_start_failures: int = 2   # a request whose start failed this often ends ERROR
    cap: int = 0                  # current limit (0: not lowered = max_batch)
    since: float = float("-inf")  # when the limit last changed
    sheds: int = 0                # times it was lowered
    ooms: int = 0                 # failures that said "out of memory"

    def limit(self, now: float) -> int:
        """The batch limit now (raises a lowered one after hold_s without failures)."""
        while self.cap and now - self.since >= self.hold_s:   # one doubling per clean hold_s
            self.cap = min(self.max_batch, self.cap * 2)
            self.since += self.hold_s
            if self.cap >= self.max_batch:
                self.cap = 0
        return self.cap or self.max_batch

    def shed(self, to: int, now: float, error: BaseException) -> int:
        """A failure at a batch of more than `to`: hold the limit at `to` (>= 1)."""
        self.cap = max(1, min(to, self.limit(now)))
        self.since = now
        self.sheds += 1
        self.ooms += is_out_of_memory(error)
        return self.cap
