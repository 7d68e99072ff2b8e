"""Weights into L2 ahead of the GEMVs that read them: a prefetch stream beside a decode step.

A decode step at a few rows is a chain of dependent kernels, each streaming a weight matrix
from HBM; between their streams (launches, ramp-up and tail of each kernel, the small
kernels: norms, attention, the delta rule) HBM sits idle. The prefetcher is one small kernel
launched on a side stream at the start of the step (inside the step's CUDA graph, beside
the chain): it walks the step's weights in the order the GEMVs read them and bulk-prefetches
them into L2 (`cp.async.bulk.prefetch.L2`), at most `window` bytes ahead of what the GEMVs
have consumed - each GEMV program adds its weight bytes to a counter after its K loop
(gemv(): `Recorder` active) - so HBM keeps streaming across the kernel boundaries and the
GEMVs' loads hit L2.

A hint only: the GEMVs compute the same sums in the same order (the counter is a separate
word). A wait that sees the counter short of its target for `timeout` polls gives up: the
program stops prefetching and returns, so a table that does not match the GEMVs in the graph
can cost the prefetch, never a hang.

Credit unit: 256 bytes (CREDIT_SHIFT), int32 counter (8 TB of weights per step at most).
Under TRITON_INTERPRET=1 the kernel runs its waits and bookkeeping without the PTX (no
prefetch, no sleep), and with LOG it records which chunks it would have prefetched: the
pacing's CPU test (test/core/test_l2_prefetch.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ._triton import tl, triton

CREDIT_SHIFT = 8        # counter units: 256 bytes


class Recorder:
    """The weights the GEMVs of a captured step read, in launch order: gemv() appends
    (address, bytes, credit) per call while this recorder is active and makes its programs
    add their credit to `counter`."""

    def __init__(self, counter: torch.Tensor):
        assert counter.dtype == torch.int32 and counter.numel() == 1
        self.counter = counter
        self.segments: list[tuple[int, int, int]] = []

    def add(self, w: torch.Tensor, credit: int) -> None:
        self.segments.append((w.data_ptr(), w.numel() * w.element_size(), credit))

    @property
    def credit(self) -> int:
        return sum(s[2] for s in self.segments)

    def table(self, device) -> torch.Tensor:
        """[n, 3] int64: address, bytes, the credit consumed before the segment."""
        rows, start = [], 0
        for addr, nbytes, credit in self.segments:
            rows.append((addr, nbytes, start))
            start += credit
        return torch.tensor(rows or [(0, 0, 0)], dtype=torch.int64, device=device)


ACTIVE: Recorder | None = None


@contextmanager
def recording(rec: Recorder):
    """gemv() calls inside report to rec (the counter and the segment list)."""
    global ACTIVE
    prev, ACTIVE = ACTIVE, rec
    try:
        yield rec
    finally:
        ACTIVE = prev


def program_credit(block_n: int, k_len: int, element_size: int) -> int:
    """What one GEMV program adds: its tile's weight bytes in counter units (at least 1)."""
    return max(1, (block_n * k_len * element_size) >> CREDIT_SHIFT)


@triton.jit
def l2_prefetch_at(addr, nbytes, NT: tl.constexpr):
    """Bulk-prefetch the bytes [addr, addr + nbytes) (addr: an int64 address) into L2
    (cp.async.bulk.prefetch.L2, sm_90): NT pieces of whole 16-byte units, one per thread; a
    hint: no result, no ordering."""
    piece = (nbytes // NT) // 16 * 16
    if piece > 0:
        t = tl.arange(0, NT)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
            [addr + t.to(tl.int64) * piece, (t * 0 + piece).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_bytes(ptr, nbytes, NT: tl.constexpr):
    """l2_prefetch_at for a pointer."""
    l2_prefetch_at(ptr.to(tl.int64, bitcast=True), nbytes, NT)


@triton.jit
def _prefetch_stream_kernel(table_ptr, n_segs, counter_ptr, window, timeout, log_ptr,
                            CHUNK: tl.constexpr, NT: tl.constexpr, SLEEP: tl.constexpr,
                            HW: tl.constexpr, LOG: tl.constexpr):
    """Program p prefetches chunks p, p + P, ... of every segment (CHUNK bytes each), chunk
    j of a segment once the counter reaches the segment's start credit + (j + 1) chunks -
    window; a wait longer than `timeout` polls ends the program."""
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    live = 1
    base = 0
    for s in range(n_segs):
        addr = tl.load(table_ptr + 3 * s)
        nbytes = tl.load(table_ptr + 3 * s + 1)
        start = tl.load(table_ptr + 3 * s + 2)
        n_chunks = ((nbytes + CHUNK - 1) // CHUNK).to(tl.int32)
        for j in range(p, n_chunks, n_prog):
            need = start + (j + 1) * (CHUNK >> 8) - window
            polls = 0
            while (live != 0) & (tl.load(counter_ptr, volatile=True) < need):
                if HW:
                    tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r",
                                              [tl.full([], SLEEP, tl.int32)], dtype=tl.int32,
                                              is_pure=False, pack=1)
                polls += 1
                if polls > timeout:
                    live = 0
            if live != 0:
                off = j * tl.full([], CHUNK, tl.int64)
                if HW:
                    l2_prefetch_at(addr + off, tl.minimum(nbytes - off, CHUNK), NT)
                if LOG:
                    tl.store(log_ptr + base + j, 1)
        base += n_chunks


def hardware(t: torch.Tensor) -> bool:
    import os
    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def launch_stream(table: torch.Tensor, counter: torch.Tensor, window_bytes: int,
                  programs: int = 16, chunk: int = 64 << 10, timeout_polls: int = 20000,
                  sleep_ns: int = 64, log: torch.Tensor | None = None) -> None:
    """One prefetcher launch over `table` (Recorder.table) on the current stream."""
    assert chunk % 256 == 0 and table.dtype == torch.int64
    hw = hardware(table)
    _prefetch_stream_kernel[(programs,)](
        table, table.shape[0], counter, window_bytes >> CREDIT_SHIFT, timeout_polls,
        log if log is not None else counter, CHUNK=chunk, NT=32, SLEEP=sleep_ns, HW=hw,
        LOG=log is not None, num_warps=1)
