"""A decode row's set-up for a new task in one launch (StepState.set_row, after the task's
prompt prefill): its hidden state and every per-row field the step pieces read
(row_setup_reference in torch is ~13 small kernels: a copy and a fill per field).

    hidden[r] = src (rounded to hidden's dtype); pos[r] = pos; pos_offset[r] = offset;
    phase[r] = phase; kind[r] = kind; first[r] = 1; temperature[r], top_p[r];
    stopped[r] = 0; stop_ids[r, :] = the stop ids, -1 padded; stop_phases[r] (0 without ids);
    seed[r] = seed where given (else left as it is)
grid (dim / BLOCK,): every program stores its block of the hidden state, program 0 the
fields. `state`: any object with those tensors as attributes (decode_step.StepState).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .row_stop import MAX_STOP_IDS


def _stop_fields(stop_ids, stop_phases: int) -> tuple[list[int], int]:
    ids = [int(t) for t in tuple(stop_ids)[:MAX_STOP_IDS]]
    return ids + [-1] * (MAX_STOP_IDS - len(ids)), (stop_phases if ids else 0)


def row_setup_reference(state, row: int, src: torch.Tensor, pos: int, phase: int, kind: int,
                        temperature: float, top_p: float, seed: int | None = None,
                        offset: int = 0, stop_ids=(), stop_phases: int = 0) -> None:
    """The fields one torch op each, in place."""
    ids, stop_phases = _stop_fields(stop_ids, stop_phases)
    state.hidden[row].copy_(src.reshape(state.hidden.shape[1:]))
    state.stopped[row:row + 1].fill_(0)
    for i, t in enumerate(ids):
        state.stop_ids[row, i:i + 1].fill_(t)
    state.stop_phases[row:row + 1].fill_(stop_phases)
    state.pos[row:row + 1].fill_(pos)
    state.pos_offset[row:row + 1].fill_(offset)
    state.phase[row:row + 1].fill_(phase)
    state.kind[row:row + 1].fill_(kind)
    state.first[row:row + 1].fill_(True)
    state.temperature[row:row + 1].fill_(temperature)
    state.top_p[row:row + 1].fill_(top_p)
    if seed is not None:
        state.seed[row:row + 1].fill_(seed)


@triton.jit(do_not_specialize=["row", "pos", "offset", "phase", "kind", "temperature",
                               "top_p", "seed", "stop_phases", "id0", "id1", "id2", "id3"])
def _row_setup_kernel(src_ptr, hidden_ptr, D, pos_ptr, offset_ptr, phase_ptr, kind_ptr,
                      first_ptr, temp_ptr, top_p_ptr, seed_ptr, stopped_ptr, ids_ptr,
                      stop_phases_ptr, row, pos, offset, phase, kind, temperature, top_p, seed,
                      stop_phases, id0, id1, id2, id3, S: tl.constexpr,
                      HAS_SEED: tl.constexpr, BLOCK: tl.constexpr):
    blk = tl.program_id(0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(src_ptr + offs, mask=ok, other=0.0)
    r = row.to(tl.int64)
    tl.store(hidden_ptr + r * D + offs, x.to(hidden_ptr.dtype.element_ty), mask=ok)
    if blk == 0:
        zero = tl.zeros([], dtype=tl.int64)
        tl.store(pos_ptr + r, zero + pos)
        tl.store(offset_ptr + r, zero + offset)
        tl.store(phase_ptr + r, zero + phase)
        tl.store(kind_ptr + r, zero + kind)
        tl.store(first_ptr + r, tl.full([], 1, tl.uint8))
        tl.store(temp_ptr + r, tl.zeros([], dtype=tl.float32) + temperature)
        tl.store(top_p_ptr + r, tl.zeros([], dtype=tl.float32) + top_p)
        if HAS_SEED:
            tl.store(seed_ptr + r, zero + seed)
        tl.store(stopped_ptr + r, tl.zeros([], dtype=tl.int32))
        tl.store(stop_phases_ptr + r, tl.zeros([], dtype=tl.int32) + stop_phases)
        i = tl.arange(0, S)
        ids = tl.where(i == 0, zero + id0, tl.where(i == 1, zero + id1,
                                                    tl.where(i == 2, zero + id2, zero + id3)))
        tl.store(ids_ptr + r * S + i, ids)


def row_setup(state, row: int, src: torch.Tensor, pos: int, phase: int, kind: int,
              temperature: float, top_p: float, seed: int | None = None, offset: int = 0,
              stop_ids=(), stop_phases: int = 0, block: int = 1024) -> None:
    """row_setup_reference as one launch: the state's tensors as StepState holds them
    (hidden [rows, dim] contiguous; pos, pos_offset, phase, kind, seed, stop_ids int64;
    first bool; temperature, top_p fp32; stopped, stop_phases int32)."""
    assert MAX_STOP_IDS == 4, "the kernel takes the stop ids as four scalars"
    ids, stop_phases = _stop_fields(stop_ids, stop_phases)
    h = state.hidden
    d = h.shape[1]
    assert h.is_contiguous() and state.stop_ids.is_contiguous() and src.numel() == d
    _row_setup_kernel[(triton.cdiv(d, block),)](
        src.reshape(d).contiguous(), h, d, state.pos, state.pos_offset, state.phase,
        state.kind, state.first.view(torch.uint8), state.temperature, state.top_p,
        state.seed, state.stopped, state.stop_ids, state.stop_phases, row, pos, offset,
        phase, kind, float(temperature), float(top_p), 0 if seed is None else seed,
        stop_phases, *ids, S=MAX_STOP_IDS, HAS_SEED=seed is not None, BLOCK=block,
        num_warps=4)


__all__ = ["row_setup", "row_setup_reference"]
