"""The megakernel for the hybrid families (megakernel/hybrid_lowering.py, hybrid_kernel.py):
tiny random fp32 Qwen 3.5 under TRITON_INTERPRET=1 (one program), one step of the persistent
kernel against the fused backend's step (megakernel_step.reference_step: its Gated DeltaNet,
gated attention and GEMV kernels), field by field: residual x, hidden, logits, the pick,
positions, the conv / delta states and the k/v cache; inactive rows keep their states."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and
                                os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from photon_core.models import qwen3_5
    return qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path_factory.mktemp("q35mk"),
                                                          seed=5)))


def _setup(model, rows=2, seed=0):
    """A FastEngine's StepState with the fused backend; random x, hidden, states and cache;
    rows at different positions (pos_offset too: M-RoPE after an image)."""
    from photon_core.fast import FastEngine

    eng = FastEngine(model, max_batch=rows, fused="on", megakernel="off")
    st, fd = eng.state, eng.state.backend
    g = torch.Generator().manual_seed(seed)
    for t in [fd.x, st.hidden, fd.kv.data, *fd.kv.states.values()]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.5)
    # (150: three key splits of 64 positions each have work; 37: one)
    st.pos[:rows] = torch.tensor([150, 37, 63, 12][:rows])
    st.pos_offset[:rows] = torch.tensor([0, -7, 3, 0][:rows])
    st.active[:rows] = True
    st.phase[:rows] = 0
    st.kind[:rows] = 0
    return st, fd


def _snapshot(st, fd):
    s = {"x": fd.x, "hidden": st.hidden, "logits": fd.bufs["logits"], "out": st.out,
         "pos": st.pos, "phase": st.phase, "first": st.first, "kv": fd.kv.data}
    s.update({f"{k[0]}.{k[1]}": v for k, v in fd.kv.states.items()})
    return {k: v.clone() for k, v in s.items()}


def _restore(st, fd, snap):
    now = {"x": fd.x, "hidden": st.hidden, "logits": fd.bufs["logits"], "out": st.out,
           "pos": st.pos, "phase": st.phase, "first": st.first, "kv": fd.kv.data}
    now.update({f"{k[0]}.{k[1]}": v for k, v in fd.kv.states.items()})
    for k, v in now.items():
        v.copy_(snap[k])


def _compare(got, want, b, what=""):
    for k in want:
        g, w = got[k], want[k]
        if k in ("x", "hidden", "logits", "out", "pos", "phase", "first"):
            g, w = g[:b], w[:b]
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{what}{k}")
        else:
            assert torch.equal(g, w), f"{what}{k}: {g.tolist()} != {w.tolist()}"


_REFS: dict = {}


def _kept_reference(key, st, fd, s0, snapshot, restore, b):
    """The fused step's (reference_step) fields from state s0, the state restored to s0. It
    is deterministic and _setup / _gemma_setup draw the same state for the same arguments:
    computed once per `key` in the module (~1.5 s interpreted; most tests start from one of
    three states), s0 asserted to be the state it ran from."""
    from photon_core.megakernel.megakernel_step import reference_step

    if key not in _REFS:
        reference_step(fd, st, b, feed=False)
        _REFS[key] = (s0, snapshot(st, fd))
        restore(st, fd, s0)
    was, want = _REFS[key]
    assert was.keys() == s0.keys()
    for k in s0:
        assert torch.equal(s0[k], was[k]), k
    return want


def _reference(model, st, fd, s0, b, rows):
    return _kept_reference((id(model), rows, b, tuple(st.active[:rows].tolist())), st, fd,
                           s0, _snapshot, _restore, b)


def _step_both(model, b, active=None, rows=2, splits=None, variant=None):
    from photon_core.megakernel.megakernel_step import MegakernelStep

    st, fd = _setup(model, rows)
    if active is not None:
        st.active[:rows] = torch.tensor(active)
    s0 = _snapshot(st, fd)
    want = _reference(model, st, fd, s0, b, rows)
    mk = MegakernelStep(fd, st, b, n_sm=1, attn_per=splits, variant=variant)
    mk.run_kernel()
    got = _snapshot(st, fd)
    assert int(mk.compiled.counters.abs().sum()) == 0      # reset for the next launch
    return s0, got, want, mk


@pytest.mark.parametrize("b,splits", [(1, None), (2, None), (1, 3), (2, 3)])
def test_hybrid_megakernel_step_matches_fused(model, b, splits):
    s0, got, want, mk = _step_both(model, b, splits=splits)
    ops = {i.op_name.rstrip("0123456789") for i in mk.compiled.instrs}
    assert {"lin", "delta", "attn", "merge", "res", "advance", "lm", "argmax"} <= ops, ops
    assert mk.low.n_split == (splits or 1)
    _compare(got, want, b)
    # the step changed what it should (not a comparison of two untouched states)
    for k in ("x", "hidden", "kv", "conv.0", "recurrent.0"):
        assert not torch.equal(got[k], s0[k]), k
    assert torch.equal(got["pos"][:b], s0["pos"][:b] + 1)


@pytest.mark.parametrize("b,variant,tile", [(1, "pipe_fma@2x32", (True, 2, 32)),
                                            (1, "pipe_fma@4x64/pre/red", (True, 4, 64)),
                                            (1, "pipe@16x64", (False, 16, 64)),
                                            (2, "pipe@16x32", (False, 16, 32)),
                                            (2, "pipe_fma@16x64/pre/red", (False, 16, 64))])
def test_gemv_tiles_match_fused(model, b, variant, tile):
    """The GEMV's one pipelined loop over (row block, K tile) steps (hybrid_kernel._hgemv) at
    tiles narrower than the GEMVs: several K tiles per row block (K 32 .. 128), the last one
    masked where BK does not divide K (96 at BK 64), partial last row blocks (136 rows at
    BN 16); FMA at one row, tl.dot otherwise (pipe_fma at two rows: tl.dot); "pre": the
    waits and the norm inside the loop's first step; "red": the residual epilogue as atomic
    adds."""
    s0, got, want, mk = _step_both(model, b, variant=variant)
    assert mk.variant.pre == ("/pre" in variant) and mk.variant.red == variant.endswith("/red")
    sh = mk.low.shape
    assert (sh["FMA"], sh["BN"], sh["BK"]) == tile
    ks = mk.low.n_gemv_k
    assert max(ks) >= 2 * sh["BK"]                          # several K tiles per block
    assert any(k % sh["BK"] for k in ks) == (sh["BK"] == 64)  # (96: a masked last tile)
    _compare(got, want, b)
    assert not torch.equal(got["x"], s0["x"])


def test_gemv_tile_reads_the_variants_gemv_field():
    """hybrid_lowering.gemv_tile: "auto" = FMA 8 x 1024 at one row, tl.dot 16 x 512 above;
    pipe_fma@RxK is FMA at one row only (tl.dot over at least 16 rows above); BK no wider
    than the widest GEMV; the Moondream-only choices and odd tiles are refused."""
    from photon_core.megakernel.hybrid_lowering import gemv_tile
    from photon_core.megakernel.lowering import Unsupported
    assert gemv_tile("auto", 1, [1024, 3584]) == (True, 8, 1024)
    assert gemv_tile("auto", 4, [1024, 3584]) == (False, 16, 512)
    assert gemv_tile("pipe_fma@8x1024", 2, [2048]) == (False, 16, 1024)
    assert gemv_tile("pipe_fma@4x256", 1, [2048]) == (True, 4, 256)
    assert gemv_tile("pipe@32x256", 1, [2048]) == (False, 32, 256)
    assert gemv_tile("auto", 1, [96, 64]) == (True, 8, 128)
    for bad in ("fma", "small", "pipe_same", "auto@8x1024", "pipe@12x512", "pipe@16x8"):
        with pytest.raises(Unsupported):
            gemv_tile(bad, 1, [1024])


def test_inactive_row_keeps_its_states(model):
    s0, got, want, _ = _step_both(model, 2, active=[True, False])
    _compare(got, want, 1)
    for k in got:
        if k.startswith(("conv.", "recurrent.")):
            assert torch.equal(got[k][1], s0[k][1]), k
    assert torch.equal(got["kv"][:, :, 1], s0["kv"][:, :, 1])
    assert int(got["pos"][1]) == int(s0["pos"][1])


def test_second_launch_from_the_state_the_first_left(model):
    from photon_core.megakernel.megakernel_step import reference_step

    s0, got, want, mk = _step_both(model, 2)
    st, fd = mk.st, mk.fd
    mk.run_kernel()
    got2 = _snapshot(st, fd)
    _restore(st, fd, got)
    reference_step(fd, st, 2, feed=False)
    _compare(got2, _snapshot(st, fd), 2, "second launch: ")


@pytest.mark.parametrize("b", [1, 2])
def test_python_twin_matches_fused_and_kernel(model, b):
    """The Python twin (python_vm.py) runs the same instruction table in queue order with
    torch ops: the fused step's results, and the kernel's."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    st, fd = _setup(model, 2)
    st.active[:2] = torch.tensor([True, b == 2])
    s0 = _snapshot(st, fd)
    want = _reference(model, st, fd, s0, b, 2)
    mk = MegakernelStep(fd, st, b, n_sm=3, attn_per=3)   # three queues interleaved by the twin
    assert len(mk.compiled.queues()) == 3
    done = mk.run_vm()
    assert len(done) == len(mk.compiled.instrs)
    vm = _snapshot(st, fd)
    _compare(vm, want, b, "twin vs fused: ")
    _restore(st, fd, s0)
    mk1 = MegakernelStep(fd, st, b, n_sm=1, attn_per=3)
    mk1.run_kernel()
    _compare(_snapshot(st, fd), vm, b, "kernel vs twin: ")


# -- Gemma 4 (window attention over rings and the capacity, KV sharing, sandwich norms, the
# per-layer input gate, layer scalars) --------------------------------------------------
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from photon_core.models import gemma4
    return gemma4.load_model(str(gemma4.make_test_model(tmp_path_factory.mktemp("g4mk"),
                                                        seed=5)))


def _gemma_setup(model, rows=2, seed=0, pos=(20, 5)):
    from photon_core.fast import FastEngine

    eng = FastEngine(model, max_batch=rows, kv_capacity=256, fused="on", megakernel="off")
    st, fd = eng.state, eng.state.backend
    g = torch.Generator().manual_seed(seed)
    tensors = [fd.x, st.hidden, fd.bufs["ple"], *fd.kv.k.values(), *fd.kv.v.values()]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.5)
    st.pos[:rows] = torch.tensor(pos[:rows])
    st.active[:rows] = True
    st.phase[:rows] = 0
    st.kind[:rows] = 0
    return st, fd


def _gemma_snapshot(st, fd):
    s = {"x": fd.x, "hidden": st.hidden, "pos": st.pos}
    s.update({f"k.{i}": t for i, t in fd.kv.k.items()})
    s.update({f"v.{i}": t for i, t in fd.kv.v.items()})
    return {k: v.clone() for k, v in s.items()}


def _gemma_restore(st, fd, snap):
    fd.x.copy_(snap["x"]), st.hidden.copy_(snap["hidden"]), st.pos.copy_(snap["pos"])
    for i in fd.kv.k:
        fd.kv.k[i].copy_(snap[f"k.{i}"]), fd.kv.v[i].copy_(snap[f"v.{i}"])


@pytest.mark.parametrize("b,splits,pos,variant", [
    (1, None, (20, 5), None), (2, None, (20, 5), None), (2, 3, (150, 6), None),
    (1, None, (20, 5), "pipe_fma@8x64/pre"), (2, 3, (150, 6), "pipe@16x64/pre")])
def test_gemma4_step_matches_fused(gemma, b, splits, pos, variant):
    """One forward piece (head=False: Gemma's lm pick, with its softcap, stays the fused
    sample piece): x, hidden, positions and every layer's ring / full k/v equal the fused
    step's (rows past their ring's size and within it; a KV-shared layer reads the slot its
    source wrote in the same launch)."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    st, fd = _gemma_setup(gemma, pos=pos)
    s0 = _gemma_snapshot(st, fd)
    want = _kept_reference((id(gemma), b, pos), st, fd, s0, _gemma_snapshot, _gemma_restore,
                           b)
    mk = MegakernelStep(fd, st, b, n_sm=1, attn_per=splits, head=False, variant=variant)
    ops = {i.op_name.rstrip("0123456789") for i in mk.compiled.instrs}
    assert {"lin", "wattn", "wmerge", "normadd", "pgate", "advance"} <= ops, ops
    mk.low.pre(b, {})      # (MegakernelStep.feed: the feedback, then this; no feedback here)
    mk.run_kernel()
    got = _gemma_snapshot(st, fd)
    assert int(mk.compiled.counters.abs().sum()) == 0
    for k in want:
        g_, w_ = (got[k][:b], want[k][:b]) if k in ("x", "hidden", "pos") else (got[k], want[k])
        if g_.dtype.is_floating_point:
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4, msg=k)
        else:
            assert torch.equal(g_, w_), k
    for k in ("x", "hidden", "k.0", "k.2", "v.3"):
        assert not torch.equal(got[k], s0[k]), k


def test_gemma4_python_twin_matches_fused_and_kernel(gemma):
    """The twin on Gemma 4's table (three queues interleaved, three key splits) = the fused
    step and = the kernel."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    st, fd = _gemma_setup(gemma, pos=(150, 6))
    s0 = _gemma_snapshot(st, fd)
    want = _kept_reference((id(gemma), 2, (150, 6)), st, fd, s0, _gemma_snapshot,
                           _gemma_restore, 2)
    results = []
    for n_sm, run in ((3, "run_vm"), (1, "run_kernel")):
        _gemma_restore(st, fd, s0)
        mk = MegakernelStep(fd, st, 2, n_sm=n_sm, attn_per=3, head=False)
        mk.low.pre(2, {})
        getattr(mk, run)()
        results.append(_gemma_snapshot(st, fd))
    for got in results:
        for k in want:
            g_, w_ = (got[k][:2], want[k][:2]) if k in ("x", "hidden", "pos") \
                else (got[k], want[k])
            torch.testing.assert_close(g_.float(), w_.float(), rtol=1e-4, atol=1e-4, msg=k)
    for k in results[0]:
        torch.testing.assert_close(results[0][k].float(), results[1][k].float(), rtol=1e-4,
                                   atol=1e-4, msg=f"twin vs kernel {k}")
