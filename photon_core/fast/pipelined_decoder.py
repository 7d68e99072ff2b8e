"""The decode loop: launch step t+1 before reading step t.

    step_batch(runs):
        launch(one step over the live runs)      # GPU work queued; no host sync
        commit(the oldest launched step)         # wait for ITS results only, apply them
    steady state: the GPU runs step t+1 while the CPU commits step t, so it never waits for
    the host between steps.

Launch: pick the bucket covering the rows in use (1, 2, 4, 8), upload the `active` mask only
when membership changed (pinned -> device, stream-ordered), replay the sample pieces the
members need and the forward piece (cuda_graph_runner.py), stage the sampled values through
the step's ping-pong slot (pingpong_slots.py), hold a refcount on every member's row.

Forward now, sample later: a detect/point row's next forward (e.g. x of the next object) is
launched before the host has committed the previous step's continue/stop decision or even
seen its coordinate; the GPU feeds the value back itself, and the host's "mask" - which of
the step's sampled values count (token vs coordinate vs size; continue vs stop) - is
applied when the step is committed. A run found finished at commit t is already in step t+1:
it rides along as a zombie and its row is released by refcount when t+1 commits.

A step whose commit surely ends every member's run (its last step in budget: the
max_tokens-th token, the step after the last object allowed) launches its sample pieces only:
its forward would feed back a value no later step samples (SKIP_FINAL_FORWARD; a run that
stops early, at eos, is learned a step late and that zombie step still runs its forward).

blocking=True (the baseline) commits each step right after launching it.
"""
from __future__ import annotations

import time

import torch

from . import cuda_graph_runner
from .cuda_graph_runner import CudaGraphRunner
from .decode_step import StepState
from .gpu_idle import GpuIdleMeter
from .pingpong_slots import PingPongSlots
from .zombie_refcount import RowRefcount

# a final step (every member's run ends at its commit) runs without its forward (False: the
# baseline, every step runs it)
SKIP_FINAL_FORWARD = True


class PipelinedDecoder:
    def __init__(self, state: StepState, runner: CudaGraphRunner, slots: PingPongSlots,
                 rows: RowRefcount, idle: GpuIdleMeter, pipelined: bool = True):
        self.state, self.runner, self.slots, self.rows, self.idle = (state, runner, slots,
                                                                    rows, idle)
        self.pipelined = pipelined
        self.next_step = 0
        self.in_flight: list = []        # launched, uncommitted slots, oldest first
        self._uploaded_active: list[bool] | None = None
        self._chain = False              # the previous step was queued back-to-back
        self.log: list[tuple] = []       # ("launch"|"commit", step, [run ids]) when recording
        self.record = False
        self.host_launch_ms: list[float] = []
        self.host_commit_ms: list[float] = []
        self.final_forwards_skipped = 0  # final steps launched without their forward

    # -- the loop -----------------------------------------------------------------------
    def step_batch(self, runs) -> list[bool]:
        live = [r for r in runs if not r.finished and not r.final_launched]
        if live:
            self.launch(live)
        if self.in_flight and (not self.pipelined or len(self.in_flight) > 1 or not live):
            self.commit()
        return [not r.finished for r in runs]

    def drain(self) -> None:
        while self.in_flight:
            self.commit()
        self._chain = False

    def break_chain(self) -> None:
        """Work other than decode steps (a prefill) is queued next: don't count the gap."""
        self._chain = False

    # -- launch ---------------------------------------------------------------------------
    def launch(self, members) -> None:
        t0 = time.perf_counter()
        if len(self.in_flight) >= 2:       # never more than the two slots
            self.commit()
        step = self.next_step
        slot = self.slots.slot_for(step)
        bucket = self.runner.bucket(max(r.row for r in members) + 1)
        active = [False] * self.state.rows
        for r in members:
            active[r.row] = True
        heads: set[str] = set()
        for r in members:
            heads.update(r.heads())
        if "lm_sample" in heads:
            heads.discard("lm")
        self.idle.start(step, chained=self._chain)
        if active != self._uploaded_active:
            slot.host_active.copy_(torch.tensor(active))
            self.state.active.copy_(slot.host_active, non_blocking=True)
            self._uploaded_active = active
        ordered = tuple(h for h in self.runner.pieces if h in heads)
        slot.members = []
        for r in members:
            phase = r.launched_step()
            self.rows.hold(r.row)
            slot.members.append((r, r.row, phase))
        # the step's forward feeds back what it samples for a step after it; when every
        # member's run surely ends at this step's commit (its last step in budget: max
        # tokens / objects) nothing reads that, so only the sample pieces run
        final = all(r.final_launched for r in members)
        staged, forward = False, None
        if final and SKIP_FINAL_FORWARD:
            self.final_forwards_skipped += 1
        else:
            # the forward with the staging copy of `out` into this slot at its end where the
            # runner built that piece (cuda_graph_runner.STAGED_FORWARD)
            names = self.runner.staged_forwards
            staged = bool(names) and cuda_graph_runner.STAGED_FORWARD
            forward = names[slot.index] if staged else "forward"
        # the heads, then the forward (the last head and a staged forward as one graph:
        # cuda_graph_runner.MERGED_STEP)
        self.runner.run_step(ordered, forward, bucket)
        self.slots.stage(slot, self.state.out, staged)
        self.idle.end(step)
        slot.step, slot.bucket, slot.heads = step, bucket, ordered
        self.in_flight.append(slot)
        self.next_step += 1
        self._chain = True
        if self.record:
            self.log.append(("launch", step, [id(r) for r in members]))
        self.host_launch_ms.append((time.perf_counter() - t0) * 1e3)

    # -- commit ---------------------------------------------------------------------------
    def commit(self) -> None:
        slot = self.in_flight.pop(0)
        out = self.slots.wait(slot)
        t0 = time.perf_counter()
        step = slot.step
        self.idle.committed(step)
        for run, row, phase in slot.members:
            run.commit(phase, out[row])
        for run, row, _ in slot.members:
            self.rows.drop(row)
        if self.record:
            self.log.append(("commit", step, [id(r) for r, _, _ in slot.members]))
        self.slots.release(slot)
        self.host_commit_ms.append((time.perf_counter() - t0) * 1e3)
