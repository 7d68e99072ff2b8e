"""The L2 weight-prefetch stream (ops/l2_prefetch.py): the prefetcher's pacing (which chunks
it issues for a given counter, window and timeout) under the interpreter, the GEMV's
progress credit (the counter ends at the recorded credit, the outputs unchanged), and on a
GPU a fused step captured with the stream beside it: the same bits as without."""
from __future__ import annotations

import os

import pytest
import torch

from photon_core.ops import l2_prefetch as l2

pytestmark = pytest.mark.skipif(not l2.triton.__name__.startswith("triton"),
                                reason="needs triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 1024           # bytes per prefetch in these tests: 4 credit units


def expected_chunks(segments, counter, window_units, programs):
    """Chunks (global index) the kernel issues: program p takes chunks p, p + P, ... of
    each segment in order and stops for good at the first one whose target the counter
    misses (need = start + (j + 1) * CHUNK / 256 - window)."""
    issued, offsets, start, base = set(), [], 0, 0
    for nbytes, credit in segments:
        offsets.append((base, start, -(-nbytes // CHUNK)))
        base += -(-nbytes // CHUNK)
        start += credit
    for p in range(programs):
        live = True
        for base, start, n in offsets:
            for j in range(p, n, programs):
                if live and counter < start + (j + 1) * CHUNK // 256 - window_units:
                    live = False
                if live:
                    issued.add(base + j)
    return issued


def run_kernel(segments, counter_value, window_units, programs):
    rows, start = [], 0
    for nbytes, credit in segments:
        rows.append((0, nbytes, start))
        start += credit
    table = torch.tensor(rows, dtype=torch.int64)
    counter = torch.tensor([counter_value], dtype=torch.int32)
    n_chunks = sum(-(-nb // CHUNK) for nb, _ in segments)
    log = torch.zeros(n_chunks, dtype=torch.int32)
    l2._prefetch_stream_kernel[(programs,)](
        table, table.shape[0], counter, window_units, 3, log, CHUNK=CHUNK, NT=4, SLEEP=0,
        HW=False, LOG=True)
    return {i for i in range(n_chunks) if log[i]}


@pytest.mark.skipif(not INTERPRETED, reason="the pacing runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("counter,window,programs", [
    (10 ** 6, 0, 1),        # everything consumed: every chunk
    (0, 8, 1),              # the window alone: the first two chunks of segment 0
    (12, 4, 1),             # into segment 0's tail
    (20, 6, 3),             # several programs, each stopping at its own first miss
    (0, 0, 2),              # nothing consumed, no window: nothing
])
def test_pacing_issues_the_chunks_the_counter_allows(counter, window, programs):
    segments = [(5 * CHUNK, 24), (3 * CHUNK + 100, 20)]     # bytes, credit (>= bytes)
    got = run_kernel(segments, counter, window, programs)
    assert got == expected_chunks(segments, counter, window, programs)
    if counter >= 10 ** 6:
        assert got == set(range(9))
    if counter == 0 and window == 0:
        assert got == set()


@pytest.mark.skipif(not INTERPRETED, reason="the GEMV kernel runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("epi", [0, 2])
def test_gemv_reports_its_credit_and_computes_the_same(epi):
    from photon_core.ops.gemv import GemvConfig, gemv
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=g)
    w = torch.randn(96, 256, generator=g).half()
    cfg = GemvConfig(32, 64, 2 if epi == 2 else 1, 4, 2, True)
    y0 = torch.zeros(2, 96) if epi == 2 else torch.zeros(2, 96, dtype=torch.half)
    y1 = y0.clone()
    gemv(x, w, None, y0, epi, cfg=cfg)
    rec = l2.Recorder(torch.zeros(1, dtype=torch.int32))
    with l2.recording(rec):
        gemv(x, w, None, y1, epi, cfg=cfg)
    assert l2.ACTIVE is None
    assert torch.equal(y0, y1)
    per_program = l2.program_credit(32, 256 // cfg.split_k, 2)
    assert rec.segments == [(w.data_ptr(), w.numel() * 2, per_program * 3 * cfg.split_k)]
    assert int(rec.counter) == rec.credit == per_program * 3 * cfg.split_k
    table = rec.table("cpu")
    assert table.tolist() == [[w.data_ptr(), w.numel() * 2, 0]]


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a GPU")
def test_fused_step_with_the_prefetch_stream_keeps_its_bits():
    from photon_core.fast import FastEngine
    from photon_core.fast.cuda_graph_runner import capture_graph
    from photon_core.fast.weight_prefetch import WeightPrefetch
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    model = build_random_model(tiny_config(fast=True), device="cuda", dtype="bf16", seed=0)
    fe = FastEngine(model, max_batch=2, kv_capacity=128, megakernel="off",
                    deterministic=True)
    st = fe.state
    st.pos.fill_(40)
    st.active.zero_()

    def step():
        fe.runner.fns["lm"](st, 1)
        fe.runner.fns["forward"](st, 1)
    step()
    plain = capture_graph(step)[0]
    wp = WeightPrefetch("cuda", 1 << 20, programs=4, chunk=16 << 10)
    with_stream = capture_graph(wp.around(step))[0]
    assert wp.fill() > 0
    outs = []
    for g in (plain, with_stream, plain):
        g.replay()
        torch.cuda.synchronize()
        outs.append([t.clone() for t in (st.hidden, *st.fused.bufs.values())])
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert int(wp.counter.item()) == wp.recorder.credit > 0
    fe.close()
