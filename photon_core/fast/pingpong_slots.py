"""Two preallocated sets of step buffers, used alternately by consecutive decode steps.

Each slot holds: the step's input metadata (the host's snapshot of which run sat in which row
and in which phase at launch, plus the pinned `active` mask uploaded when membership
changes), a device staging copy of the sampled values, their pinned host copy, and events.
Step t+1 is launched into one slot while the CPU reads step t's results from the other: the
compute stream copies the sampled values into the slot's staging buffer and records `done`;
a separate copy stream waits for `done` and copies device -> pinned host asynchronously,
recording `copied`. The host waits only on `copied` of the step it commits. A slot is
reused two steps later, after its previous step was committed, so no buffer is overwritten
while in flight. On the CPU every copy is immediate and events are None.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepSlot:
    index: int
    dev_out: torch.Tensor
    host_out: torch.Tensor
    host_active: torch.Tensor
    done: object = None
    copied: object = None
    step: int = -1                      # global step number launched into it; -1 when free
    members: list = field(default_factory=list)   # [(run, row, phase), ...] at launch
    bucket: int = 0
    heads: tuple = ()


class PingPongSlots:
    def __init__(self, rows: int, device: torch.device):
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.slots = []
        for i in range(2):
            self.slots.append(StepSlot(
                index=i,
                dev_out=torch.zeros(rows, 4, dtype=torch.long, device=device),
                host_out=torch.zeros(rows, 4, dtype=torch.long, pin_memory=pin),
                host_active=torch.zeros(rows, dtype=torch.bool, pin_memory=pin),
                done=torch.cuda.Event() if self.cuda else None,
                copied=torch.cuda.Event() if self.cuda else None))
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def slot_for(self, step: int) -> StepSlot:
        s = self.slots[step % 2]
        if s.step != -1:
            raise RuntimeError(f"slot {s.index} still holds uncommitted step {s.step}")
        return s

    def stage(self, slot: StepSlot, out: torch.Tensor, staged: bool = False) -> None:
        """Enqueue: device outputs -> slot staging (compute stream; staged: done already, by
        the step's forward graph - cuda_graph_runner's "forward#i") -> pinned host (copy
        stream). Nothing waits here."""
        if not staged:
            slot.dev_out.copy_(out)
        if not self.cuda:
            slot.host_out.copy_(slot.dev_out)
            return
        slot.done.record()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.done)
            slot.host_out.copy_(slot.dev_out, non_blocking=True)
            slot.copied.record(self.copy_stream)

    def wait(self, slot: StepSlot) -> list[list[int]]:
        """Block until the slot's host copy landed; return its rows as python ints."""
        if self.cuda:
            slot.copied.synchronize()
        return slot.host_out.tolist()

    def release(self, slot: StepSlot) -> None:
        slot.step = -1
        slot.members = []
