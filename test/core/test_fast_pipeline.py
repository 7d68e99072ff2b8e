"""Pipeline mechanics of photon_core.fast on the CPU: commit order, ping-pong slot reuse,
zombie refcounts, the engine protocol the scheduler uses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core.fast import FastEngine
from photon_core.fast.pingpong_slots import PingPongSlots
from photon_core.fast.zombie_refcount import RowRefcount
from photon_core.moondream.model import build_random_model
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config
from photon_core.task import Task


@pytest.fixture(scope="module")
def model():
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def enc(model):
    return model.encode_image(np.random.default_rng(0).integers(0, 256, (120, 160, 3),
                                                                dtype=np.uint8))


def _events(fe):
    return [(kind, step) for kind, step, _ in fe.decoder.log]


def test_pipelined_launches_next_step_before_committing_previous(model, enc):
    fe = FastEngine(model, max_batch=2)
    fe.decoder.record = True
    r = fe.start(enc, Task("query", question="What?", max_tokens=5), ignore_eos=True)
    while r.step():
        pass
    fe.drain()
    ev = _events(fe)
    assert ev[:5] == [("launch", 0), ("launch", 1), ("commit", 0), ("launch", 2), ("commit", 1)]
    commits = [s for k, s in ev if k == "commit"]
    assert commits == sorted(commits) == list(range(len(commits)))   # in order, each once
    # step t+1 is always launched before step t is committed
    for t in commits[:-1]:
        assert ev.index(("launch", t + 1)) < ev.index(("commit", t))
    # max_tokens reached: the 5th step surely ends the run, so no 6th (zombie) is launched
    assert r.result().tokens == 5 and len(commits) == 5
    fe.close()


def test_blocking_commits_each_step_before_the_next(model, enc):
    fe = FastEngine(model, max_batch=2, pipelined=False)
    fe.decoder.record = True
    fe.run(enc, Task("query", question="What?", max_tokens=4), ignore_eos=True)
    ev = _events(fe)
    assert ev == [(k, s) for s in range(4) for k in ("launch", "commit")]
    fe.close()


def test_slots_alternate_and_refuse_reuse_while_in_flight():
    slots = PingPongSlots(2, torch.device("cpu"))
    a = slots.slot_for(0)
    a.step = 0
    assert slots.slot_for(1).index != a.index
    with pytest.raises(RuntimeError):
        slots.slot_for(2)
    slots.release(a)
    assert slots.slot_for(2) is a


def test_refcount_releases_zombie_row_only_after_its_last_step():
    class Run:
        finished = False
        row = None
    rows = RowRefcount(2)
    r = Run()
    row = rows.acquire(r)
    r.row = row
    rows.hold(row)
    rows.hold(row)           # two launched steps
    r.finished = True
    rows.finished(row)
    assert rows.owner[row] is r
    rows.drop(row)
    assert rows.owner[row] is r
    rows.drop(row)
    assert rows.owner[row] is None and rows.released == [row] and r.row is None


def test_finished_row_is_reused_after_zombie_commit(model, enc):
    fe = FastEngine(model, max_batch=2)
    a = fe.start(enc, Task("query", question="What?", max_tokens=20), ignore_eos=True)
    b = fe.start(enc, Task("query", question="Why?", max_tokens=8), ignore_eos=True)
    assert (a.row, b.row) == (0, 1)
    fe.step_batch([a, b])
    fe.step_batch([a, b])
    a.cancel()
    assert fe.rows.owner[0] is a           # a zombie step of a is still launched
    fe.step_batch([a, b])
    assert fe.rows.owner[0] is None and fe.rows.released == [0]
    c = fe.start(enc, Task("detect", object="person", max_objects=2))
    assert c.row == 0
    runs = [b, c]
    while any(fe.step_batch(runs)):
        pass
    fe.drain()
    assert c.result().output == model.run(enc, c.task).output
    fe.close()


def test_start_drains_when_all_rows_are_held_by_zombies(model, enc):
    fe = FastEngine(model, max_batch=1)
    a = fe.start(enc, Task("query", question="What?", max_tokens=20), ignore_eos=True)
    a.step()
    a.step()
    a.cancel()
    assert fe.rows.owner[0] is a and fe.decoder.in_flight
    b = fe.start(enc, Task("point", object="cup", max_objects=1))
    assert b.row == 0 and not fe.decoder.in_flight
    fe.close()


def test_engine_protocol_and_scheduler_step_batch(model, enc):
    from photon_core.scheduler.engine import EngineLike, TaskRunLike, step_batch
    fe = FastEngine(model, max_batch=4)
    assert isinstance(fe, EngineLike)
    runs = [fe.start(enc, Task("query", question="What?", max_tokens=3)),
            fe.start(enc, Task("detect", object="cup", max_objects=2))]
    assert all(isinstance(r, TaskRunLike) for r in runs)
    while any(step_batch(fe, runs)):
        pass
    fe.drain()
    for r in runs:
        assert r.result().output == model.run(enc, r.task).output
    assert fe.metrics()["pipelined"] is True
    fe.close()


def test_gpu_idle_metric_is_empty_on_cpu(model, enc):
    fe = FastEngine(model, max_batch=1)
    fe.run(enc, Task("query", question="What?", max_tokens=3))
    assert fe.metrics()["gpu_idle_per_step"] == {}
    fe.close()


def test_fast_rope_equals_reference_rope():
    from photon_core.ops.rope import rope, rope_perms, rope_tables
    from photon_core.moondream.rope import apply_rope, rope_angles
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 1, 64, generator=g)
    pos = torch.tensor([0, 731, 2047])
    perm = rope_perms(32, 64)       # the rotated pairs come out interleaved, like apply_rope
    c, s = rope_tables(pos, 32, 64)
    cos, sin = rope_angles(pos, 32)
    ref = apply_rope(x, cos[:, None, None, :], sin[:, None, None, :])
    torch.testing.assert_close(rope(x, c, s, perm), ref, rtol=1e-6, atol=1e-6)


def _engine_with(model, monkeypatch, module, switch: str, value):
    """A FastEngine (max_batch 2) built with the module switch `switch` set to value."""
    monkeypatch.setattr(module, switch, value)
    return FastEngine(model, max_batch=2)


def _recorded(fe, after=None) -> list:
    """The piece names the engine's decoder launches, in order (after(name): called once
    each has run)."""
    runner, names = fe.decoder.runner, []
    inner = runner.run

    def run(name, bucket):
        inner(name, bucket)
        names.append(name)
        if after is not None:
            after(name)
    runner.run = run
    return names


def _forward_counting(fe):
    """Count the forward pieces the engine's decoder launches."""
    runner, calls = fe.decoder.runner, []
    inner = runner.run

    def run(name, bucket):
        # (forward#i: with the slot's staging copy; "coord+forward#i": after a head piece)
        if name.split("+")[-1].split("#")[0] == "forward":
            calls.append(bucket)
        return inner(name, bucket)
    runner.run = run
    return calls


def test_final_step_runs_without_its_forward(model, enc, monkeypatch):
    """pipelined_decoder.SKIP_FINAL_FORWARD: a step whose commit surely ends its run (the
    max_tokens-th token; the step that completes the last allowed object) launches its
    sample pieces only - the same outputs and finish reasons as with the forward, one forward
    less per run that reaches its budget, none less for a run that stops early (its zombie
    step is not known final at launch). A region task at its budget takes its phases' steps
    and no more (detect 3, point 2 per object: no step asks whether another follows)."""
    from photon_core.fast import pipelined_decoder
    tasks = [(Task("query", question="What?", max_tokens=5), True),
             (Task("detect", object="cat", max_objects=2), True),
             (Task("point", object="cup", max_objects=2), True),
             (Task("query", question="What?", max_tokens=40), False)]
    got = {}
    for skip in (True, False):
        fe = _engine_with(model, monkeypatch, pipelined_decoder, "SKIP_FINAL_FORWARD", skip)
        calls = _forward_counting(fe)
        for i, (t, ignore_eos) in enumerate(tasks):
            before = len(calls)
            r = fe.start(enc, t, ignore_eos=ignore_eos)
            while r.step():
                pass
            fe.drain()
            res = r.result()
            got[skip, i] = ((res.output, res.tokens, res.finish_reason),
                            len(calls) - before, r.launched)
        # two runs in one batch: the shorter one's final step still forwards the other
        runs = [fe.start(enc, Task("query", question="What?", max_tokens=n), ignore_eos=True)
                for n in (3, 6)]
        while any(fe.step_batch(runs)):
            pass
        fe.drain()
        got[skip, "batch"] = [(r.result().output, r.result().tokens) for r in runs]
        assert fe.decoder.final_forwards_skipped == (4 if skip else 0)
        fe.close()
    assert got[True, "batch"] == got[False, "batch"]
    assert [t for _, t in got[True, "batch"]] == [3, 6]
    for i, (t, ignore_eos) in enumerate(tasks):
        (out1, fwd1, launched1), (out0, fwd0, launched0) = got[True, i], got[False, i]
        assert out1 == out0 and launched1 == launched0, (t, out1, out0)
        assert fwd0 == launched0
        assert fwd1 == launched1 - (1 if ignore_eos else 0), t
    assert got[True, 3][0][2] == "stop"          # the early stop: its zombie step forwarded
    assert got[True, 1][0][2] == "length" and len(got[True, 1][0][0]["objects"]) == 2
    assert got[True, 1][1:] == (5, 6) and got[True, 2][1:] == (3, 4)    # (forwards, steps)


def test_forward_stages_the_sampled_values_into_its_slot(model, enc, monkeypatch):
    """cuda_graph_runner.STAGED_FORWARD: a step's forward piece copies `out` into its
    ping-pong slot's staging buffer at its end ("forward#0" / "forward#1", one graph each on
    the GPU) instead of a copy after it: steps alternate the two pieces, each leaves the
    slot's buffer equal to `out`, and the outputs equal the plain forward + copy's."""
    from photon_core.fast import cuda_graph_runner
    tasks = [Task("detect", object="cat", max_objects=3), Task("query", question="What?",
                                                                max_tokens=6)]
    got = {}
    for staged in (True, False):
        fe = _engine_with(model, monkeypatch, cuda_graph_runner, "STAGED_FORWARD", staged)
        assert ("forward#0" in fe.runner.fns and "forward#1" in fe.runner.fns) == staged

        def slot_equals_out(name, fe=fe):
            name = name.split("+")[-1]          # (a head piece merged before it)
            if name.startswith("forward#"):
                assert torch.equal(fe.slots.slots[int(name[-1])].dev_out, fe.state.out)
        names = _recorded(fe, slot_equals_out)
        runs = [fe.start(enc, t) for t in tasks]
        while any(fe.step_batch(runs)):
            pass
        fe.drain()
        got[staged] = [(r.result().output, r.result().tokens) for r in runs]
        fwd = [n.split("+")[-1] for n in names if "forward" in n]
        if staged:
            assert fwd and fwd[:4] == ["forward#0", "forward#1"] * 2
        else:
            assert fwd and set(fwd) == {"forward"}
        fe.close()
    assert got[True] == got[False]


def test_merged_step_pieces(model, enc, monkeypatch):
    """cuda_graph_runner.MERGED_STEP: a step's last head piece and its staged forward run as
    one piece ("coord+forward#0": one CUDA graph on the GPU), the heads before it alone: the
    same outputs as every piece apart; a final step (no forward) runs its heads alone."""
    from photon_core.fast import cuda_graph_runner
    tasks = [Task("detect", object="cat", max_objects=2), Task("query", question="What?",
                                                                max_tokens=5)]
    got = {}
    for on in (True, False):
        fe = _engine_with(model, monkeypatch, cuda_graph_runner, "MERGED_STEP", on)
        assert bool(fe.runner.merged_pieces) == on
        assert ("lm+forward#1" in fe.runner.fns) == on
        names = _recorded(fe)
        for t in tasks:
            r = fe.start(enc, t, ignore_eos=True)
            while r.step():
                pass
            fe.drain()
            got[on, t.skill] = (r.result().output, r.result().tokens, names[:])
            names.clear()
        fe.close()
    for skill in ("detect", "query"):
        (out1, n1, names1), (out0, n0, names0) = got[True, skill], got[False, skill]
        assert (out1, n1) == (out0, n0)
        # apart: the same pieces in the same order
        assert [p for n in names1 for p in n.split("+")] == names0
        merged = [n for n in names1 if "+" in n]
        assert merged and all("forward#" in n.split("+")[1] for n in merged)
        assert len(merged) == sum(n.startswith("forward") for n in names0)
    # detect: an x step runs lm alone, then coord + forward as one piece
    assert got[True, "detect"][2][:2] == ["lm", "coord+forward#0"]

