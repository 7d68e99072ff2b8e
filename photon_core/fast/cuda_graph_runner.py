"""Runs the decode-step pieces for one batch bucket: CUDA graphs on the GPU, eager on the CPU.

Pieces (decode_step.py): "lm" (greedy lm head), "lm_sample" (temperature/top-p rows), the
program's other heads (Moondream: "coord", "size") and "forward" (GPU-resident feedback +
decoder + state update).
A step launches only the pieces its rows need. At warm-up every (piece, bucket) is captured
once for buckets 1, 2, 4, 8 (all graphs share one memory pool; pieces talk only through the
preallocated StepState, so replaying them in any order is safe). Replays allocate nothing and
never synchronize with the host. On the CPU (CI) the same runner calls the pieces eagerly,
so the pipeline logic above it is identical.
"""
from __future__ import annotations

import contextlib
import gc

from typing import Callable

import torch

from . import decode_step as ds

# Python's cyclic garbage collector is paused while a graph is captured (PAUSE_GC): a
# collection that runs inside a capture and frees a dead CUDA graph (an earlier engine's, a
# closed engine's: engines hold reference cycles) calls cudaGraphExecDestroy, which is not
# allowed during a capture and invalidates it ("operation failed due to a previous error
# during capture", with "operation not permitted when stream is capturing (function reset)"
# warnings). torch.cuda.graph does not collect before capturing (the builds here: 2.11 on
# the H200, 2.13 on the CPU; only with torch.compiler.config.force_cudagraph_gc), so
# whether a collection fell inside a capture depended on allocation counts: session 35's GPU
# test failures on fresh machines (their Triton compiles allocate), reproduced in session 36
# call 1 (docs/benchmarks.md); the garbage is collected after the capture instead.
PAUSE_GC = True
# cudaStreamCaptureMode of every capture here: "thread_local" - a call that is not allowed
# during a capture invalidates it only when the capturing thread makes it (torch's default
# "global": any thread's; the node's executor and the scheduler's worker run beside an
# engine that captures at a lifecycle re-activate)
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def capturing():
    """The block with the cyclic garbage collector paused (PAUSE_GC; restored after)."""
    paused = PAUSE_GC and gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def warm_up(fn: Callable[[], object], capture_stream=None) -> None:
    """Run fn once on the capture stream (or a side stream), before capturing it: lazy
    allocations, cuBLAS / cuDNN picks and Triton compiles happen outside the capture."""
    side = capture_stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(fn: Callable[[], object], capture_stream=None, pool=None):
    """(the CUDA graph of fn, fn's output: the graph's static result); pool: a memory pool
    shared with other graphs (torch.cuda.graph_pool_handle()). Errors of the capture
    propagate (the caller decides what runs instead)."""
    g = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.graph(g, pool=pool, stream=capture_stream,
                                       capture_error_mode=CAPTURE_ERROR_MODE):
        out = fn()
    torch.cuda.synchronize()
    return g, out


class GraphParts:
    """Consecutive CUDA graphs replayed in order as one (capture_graph_parts)."""

    def __init__(self, graphs: list):
        self.graphs = graphs

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()


def capture_graph_parts(fn: Callable[[Callable[[], None]], object], capture_stream=None
                        ) -> tuple[GraphParts, object]:
    """fn(cut) captured as consecutive graphs, one memory pool: each cut() call inside fn
    ends the graph being captured and begins the next. Replaying them in order is fn's work;
    the host launches a short first part and the GPU starts on it while the host launches
    the rest (one long graph keeps the GPU idle through its whole launch). Errors of the
    capture propagate."""
    pool = torch.cuda.graph_pool_handle()
    stream = capture_stream if capture_stream is not None else torch.cuda.Stream()
    graphs = [torch.cuda.CUDAGraph()]

    def cut() -> None:
        graphs[-1].capture_end()
        graphs.append(torch.cuda.CUDAGraph())
        graphs[-1].capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)

    torch.cuda.synchronize()
    with capturing(), torch.cuda.stream(stream):
        graphs[0].capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        try:
            out = fn(cut)
        except BaseException:
            with contextlib.suppress(Exception):    # end the capture; fn's error propagates
                graphs[-1].capture_end()
            raise
        graphs[-1].capture_end()
    torch.cuda.synchronize()
    return GraphParts(graphs), out


BUCKETS = (1, 2, 4, 8)


def buckets_for(rows: int) -> tuple[int, ...]:
    out = [b for b in BUCKETS if b < rows]
    return tuple(out + [rows])


# the forward piece captured once per ping-pong slot with the step's staging copy of `out`
# into that slot at its end ("forward#i"): one graph boundary less per step (H200, session 30
# call 9: Moondream 2's detect coordinate step 33.9 us between megakernels vs 41.4, one call
# detect(5) 30.23 vs 30.34 ms, query(32) 44.52 vs 44.60, same process). On since session 32
# (a669e97): session 30's Qwen 3.5 / Gemma 4 GPU test failures with it were the tree's
# (start()'s borrow keyword, fixed before its last commit): with it on, those files passed
# (session 31 call 1), and every GPU test file (session 32 calls 1-3). Read when the runner
# is built (the pieces are captured only when on) and at each launch by pipelined_decoder
# (off there: the plain forward and the copy after it).
STAGED_FORWARD = True


# each head piece captured once more with each staged forward after it in the same graph
# ("coord+forward#0"): a step replays its last head piece and its forward as one graph, one
# graph boundary less per step (pipelined_decoder's launch; the same kernels in the same
# order on the same stream: the same bits). Read when the runner is built and at each launch.
MERGED_STEP = True


def merged(*fns: Callable) -> Callable:
    """The pieces fns run one after the other as one piece."""
    def piece(st: ds.StepState, b: int) -> None:
        for fn in fns:
            fn(st, b)
    return piece


def staged(fn: Callable, target: torch.Tensor) -> Callable:
    """fn (a forward piece), then the sampled values `out` copied into `target` (a slot's
    staging buffer: pingpong_slots.PingPongSlots.stage's copy)."""
    def piece(st: ds.StepState, b: int) -> None:
        fn(st, b)
        target.copy_(st.out)
    return piece


class CudaGraphRunner:
    def __init__(self, state: ds.StepState, rows: int, use_graphs: bool,
                 stage_into: list[torch.Tensor] | tuple = ()):
        """stage_into: the ping-pong slots' staging buffers; "forward#i" = the forward then
        the copy of `out` into stage_into[i] (STAGED_FORWARD)."""
        self.state = state
        self.buckets = buckets_for(rows)
        self.use_graphs = use_graphs
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        eager_lm_sample = ds.lm_sample if use_graphs else ds.lm_sample_eager
        self.fns: dict[str, Callable] = {"lm": ds.lm_greedy, "lm_sample": eager_lm_sample}
        for name, _ in state.program.heads:
            self.fns.setdefault(name, ds.head(name))
        self.fns["forward"] = ds.forward
        # the staged forwards' piece names by slot (empty: not built, STAGED_FORWARD off)
        n = len(stage_into) if STAGED_FORWARD else 0
        self.staged_forwards = tuple(f"forward#{i}" for i in range(n))
        for name, t in zip(self.staged_forwards, stage_into):
            self.fns[name] = staged(ds.forward, t)
        # launch order of a step's pieces: the sample pieces, then the forward
        self.pieces = tuple(self.fns)
        # a head piece + a staged forward as one piece (MERGED_STEP): "head+forward#i"
        heads = [h for h in self.pieces if not h.startswith("forward")]
        self.merged = {(h, f): f"{h}+{f}" for h in heads for f in self.staged_forwards} \
            if MERGED_STEP else {}
        self.merged_pieces = tuple(self.merged.values())
        for (h, f), name in self.merged.items():
            self.fns[name] = merged(self.fns[h], self.fns[f])
        self.capture_ms = 0.0
        self.capture_stream = None   # set by FastEngine: its own stream (fast_engine.py)

    def bucket(self, n_rows: int) -> int:
        for b in self.buckets:
            if b >= n_rows:
                return b
        raise ValueError(f"{n_rows} rows exceed the largest bucket {self.buckets[-1]}")

    def capture(self) -> None:
        """Warm up and capture every (piece, bucket). The state is saved and restored around
        it and all rows are inactive (their k/v writes land on not-yet-valid positions), so
        capturing disturbs no row already in use."""
        if not self.use_graphs or self.graphs:
            return
        import time
        t0 = time.perf_counter()
        st = self.state
        saved = {n: getattr(st, n).clone() for n in
                 ("hidden", "pos", "phase", "first", "active", "out")}
        st.active.zero_()   # inactive rows: capture runs do not advance anything

        def every_piece():
            for b in self.buckets:
                for name in self.pieces:
                    self.fns[name](st, b)
        with torch.inference_mode():
            warm_up(lambda: (every_piece(), every_piece()), self.capture_stream)
            self.pool = torch.cuda.graph_pool_handle()
            for b in self.buckets:
                for name in self.pieces + self.merged_pieces:
                    self.graphs[(name, b)] = capture_graph(
                        lambda: self.fns[name](st, b), self.capture_stream, self.pool)[0]
        for n, t in saved.items():
            getattr(st, n).copy_(t)
        torch.cuda.synchronize()
        self.capture_ms = (time.perf_counter() - t0) * 1e3

    def run(self, name: str, bucket: int) -> None:
        g = self.graphs.get((name, bucket))
        if g is not None:
            g.replay()
        else:
            self.fns[name](self.state, bucket)

    def run_step(self, heads: tuple[str, ...], forward: str | None, bucket: int) -> None:
        """A step's head pieces (in launch order), then its forward piece (None: none); the
        last head and a staged forward as their merged piece where it was built
        (MERGED_STEP)."""
        name = self.merged.get((heads[-1], forward)) if heads and MERGED_STEP else None
        if name is not None:
            heads, forward = heads[:-1], name
        for h in heads:
            self.run(h, bucket)
        if forward is not None:
            self.run(forward, bucket)
