"""Which rows have stopped, on the GPU: after a step's heads picked their values and before its
forward, a row whose lm pick (out[r, 0]) is one of its stop tokens in a phase that stops on
it (bit `phase` of its stop-phase mask; a text task's phase, Moondream 2's x phase) is marked
stopped, for good (set_row clears it for the next task). A stopped row's run ends when the
host commits that step; until then its forwards feed nothing anyone reads (the step that
sampled the stop token, and the zombie step launched after it), so a backend may skip work
for it (megakernel_backend.SKIP_STOPPED: the megakernel's programs skip their queues when
every active row of the bucket has stopped).

    stopped[r] |= (stop_phases[r] >> phase[r]) & 1  and  out[r, 0] in stop_ids[r, :]
stop_ids [rows, S] (-1 pads), stop_phases [rows] (0: the row never stops here, e.g. a task
that ignores eos).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

MAX_STOP_IDS = 4


def row_stop_reference(out: torch.Tensor, phase: torch.Tensor, stop_ids: torch.Tensor,
                       stop_phases: torch.Tensor, stopped: torch.Tensor) -> torch.Tensor:
    """In place on stopped [b] (int32); every argument holds the bucket's b rows."""
    hit = ((stop_ids == out[:, :1]) & (stop_ids >= 0)).any(dim=1)      # the kernel's test
    on = ((stop_phases >> phase) & 1).bool()
    stopped |= (hit & on).to(stopped.dtype)
    return stopped


@triton.jit
def _row_stop_kernel(out_ptr, phase_ptr, ids_ptr, mask_ptr, stopped_ptr, S: tl.constexpr):
    r = tl.program_id(0)
    tok = tl.load(out_ptr + r * 4)
    ph = tl.load(phase_ptr + r)
    ids = tl.load(ids_ptr + r * S + tl.arange(0, S))
    hit = tl.sum(((ids == tok) & (ids >= 0)).to(tl.int32), axis=0) > 0
    on = ((tl.load(mask_ptr + r) >> ph.to(tl.int32)) & 1) != 0
    old = tl.load(stopped_ptr + r)
    tl.store(stopped_ptr + r, tl.where(hit & on, 1, old))


def row_stop(out: torch.Tensor, phase: torch.Tensor, stop_ids: torch.Tensor,
             stop_phases: torch.Tensor, stopped: torch.Tensor) -> torch.Tensor:
    """row_stop_reference as one launch (a program per row): out [b, 4] int64, phase [b]
    int64, stop_ids [b, MAX_STOP_IDS] int64, stop_phases [b] int32, stopped [b] int32 (row
    views of the StepState's tensors, contiguous rows)."""
    b = out.shape[0]
    assert stop_ids.shape == (b, MAX_STOP_IDS) and stopped.dtype == torch.int32
    if b:
        _row_stop_kernel[(b,)](out, phase, stop_ids, stop_phases, stopped, S=MAX_STOP_IDS)
    return stopped


__all__ = ["MAX_STOP_IDS", "row_stop", "row_stop_reference"]
