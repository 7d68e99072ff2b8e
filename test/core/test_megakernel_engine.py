"""The megakernel as FastEngine's step backend (EngineOptions.megakernel,
photon_core/megakernel/megakernel_backend.py) on the CPU under TRITON_INTERPRET=1, tiny fp32
Moondream: the pipelined runtime (ping-pong slots, forward-now-sample-later, zombies) drives
it unchanged and every decoded output (text, coordinates, token counts, finish reasons) is
the fused backend's (fused="on"), at batch 1 and 2 and with a run cancelled mid-flight; the
forward pieces really go through the megakernel. Where it cannot serve (fused backend off) the
engine keeps the fused backend and says why; Qwen 3.5 goes through the hybrid lowering.
The H200 side (cooperative launch, graphs, bf16): bench/bench_megakernel.py."""
from __future__ import annotations

import logging
import os
import tempfile
import sys

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from photon_core.engine import EngineOptions  # noqa: E402
from photon_core.fast import FastEngine  # noqa: E402
from photon_core.megakernel.megakernel_step import Variant  # noqa: E402
from photon_core.moondream.model import build_random_model  # noqa: E402
from photon_core.moondream.test_model import TEST_EOS_BIAS, tiny_config  # noqa: E402
from photon_core.task import Task  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_runs import cancel_mid_flight, run_to_end  # noqa: E402

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
cpu_only = pytest.mark.skipif(GPU, reason="interpreter tests")
gpu_only = pytest.mark.skipif(not GPU, reason="CUDA (no interpreter)")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0)


@pytest.fixture(scope="module")
def encs(model):
    rng = np.random.default_rng(0)
    return [model.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((120, 160), (90, 200))]


class FusedRuns:
    """The reference side: the fused backend's engines (fused="on", megakernel="off"), one
    per max_batch, and their results kept by (max_batch, way, (image, task) pairs). Several
    tests compare the megakernel with the same fused runs (5-20 s each interpreted): each is
    decoded once per module; the megakernel side always runs afresh."""

    def __init__(self, model):
        self.model, self.engines, self.kept = model, {}, {}

    def engine(self, rows):
        if rows not in self.engines:
            fu = FastEngine(self.model, max_batch=rows, fused="on", megakernel="off")
            assert fu.state.backend is fu.state.fused and fu.state.megakernel is None
            assert "megakernel" not in fu.metrics()
            self.engines[rows] = fu
        return self.engines[rows]

    def _kept(self, key, make):
        if key not in self.kept:
            self.kept[key] = make()
        return self.kept[key]

    def run(self, rows, enc, task):
        """engine.run(enc, task)'s result."""
        return self._kept((rows, "run", id(enc), repr(task)),
                          lambda: self.engine(rows).run(enc, task))

    def decode(self, rows, pairs):
        """_decode's results: the pairs stepped as one batch."""
        return self._kept((rows, "decode", tuple((id(e), repr(t)) for e, t in pairs)),
                          lambda: _decode(self.engine(rows), pairs))

    def close(self):
        for fe in self.engines.values():
            fe.close()


@pytest.fixture(scope="module")
def fused(model, encs):          # (encs: the images the keys name live as long as this)
    runs = FusedRuns(model)
    yield runs
    runs.close()


TASKS = [Task("detect", object="person", max_objects=3),
         Task("point", object="cup", max_objects=3),
         Task("query", question="What is it?", max_tokens=8),
         Task("detect", object="car", max_objects=1)]


# the hybrid kernel's GEMV forms on the GPU: tl.dot tiles, FMA with the waits inside the
# pipelined loop (pre, session 24)
HYBRID_VARIANTS = ["auto/w8/s2", "pipe_fma@8x1024/w8/s3/pre/red/elide/rpf"]   # (HYBRID_BEST)


def same(a, b):
    return (a.output, a.tokens, a.finish_reason) == (b.output, b.tokens, b.finish_reason)


class Launches:
    """Counts the megakernel launches (MegakernelStep.run_kernel) per bucket."""

    def __init__(self, monkeypatch):
        from photon_core.megakernel.megakernel_step import MegakernelStep
        self.by_bucket: dict[int, int] = {}
        real = MegakernelStep.run_kernel

        def counted(step, **kw):
            self.by_bucket[step.b] = self.by_bucket.get(step.b, 0) + 1
            return real(step, **kw)
        monkeypatch.setattr(MegakernelStep, "run_kernel", counted)


def _engines(fused, rows, spec="on"):
    """The fused reference engine (FusedRuns) and a fresh megakernel engine."""
    fu = fused.engine(rows)
    mk = FastEngine(fused.model, max_batch=rows, fused="on", megakernel=spec)
    from photon_core.megakernel.megakernel_backend import MegakernelBackend
    assert isinstance(mk.state.backend, MegakernelBackend), mk.state.megakernel_fallback
    assert mk.metrics()["megakernel_fallback"] == ""
    return fu, mk


def _decode(fe, pairs):
    runs = run_to_end(fe, pairs)
    assert all(o is None for o in fe.rows.owner)
    return [r.result() for r in runs]


@cpu_only
def test_batch_1_every_skill_matches_fused(fused, encs, monkeypatch):
    _, mk = _engines(fused, 1)
    n = Launches(monkeypatch)
    for k, t in enumerate(TASKS):          # every skill, both images (each run ~10 s here)
        a, b = fused.run(1, encs[k % 2], t), mk.run(encs[k % 2], t)
        assert same(a, b), (t, a.output, b.output)
    assert n.by_bucket.get(1, 0) > 10 and set(n.by_bucket) == {1}
    mk.close()


@cpu_only
def test_batch_2_mixed_skills_with_zombies_match_fused(fused, encs, monkeypatch):
    _, mk = _engines(fused, 2, spec="auto/w8")    # a variant string: every bucket
    n = Launches(monkeypatch)
    mk.decoder.record = True
    zombies = 0
    for k in range(0, len(TASKS), 2):      # every skill once, in pairs of different images
        pairs = [(encs[(k + j) % 2], TASKS[(k + j) % len(TASKS)]) for j in range(2)]
        want = fused.decode(2, pairs)
        runs = [mk.start(e, t) for e, t in pairs]
        while any(mk.step_batch(runs)):
            pass
        mk.drain()
        zombies += sum(r.committed > r.steps for r in runs)      # rode along after finishing
        for w, r in zip(want, runs):
            assert same(w, r.result()), (k, w.output, r.result().output)
        assert all(o is None for o in mk.rows.owner)
    assert zombies > 0
    assert n.by_bucket.get(2, 0) > 0
    mk.close()


@cpu_only
def test_on_runs_buckets_above_one_on_the_fused_forward(fused, encs, monkeypatch):
    """megakernel="on" is the measured b=1 win: bucket 2 runs the fused forward (said in
    the backend's fused_buckets), with the same outputs."""
    _, mk = _engines(fused, 2)
    n = Launches(monkeypatch)
    pairs = [(encs[j], TASKS[j]) for j in range(2)]
    for w, g in zip(fused.decode(2, pairs), _decode(mk, pairs)):
        assert same(w, g), (w.output, g.output)
    be = mk.state.backend
    assert 2 in be.fused_buckets and 1 not in be.fused_buckets, be.fused_buckets
    assert n.by_bucket.get(2, 0) == 0
    mk.close()


@cpu_only
def test_a_bucket_whose_build_fails_runs_the_fused_forward(fused, encs, monkeypatch):
    """A bucket's first launch compiles its kernel (on CUDA); where that fails (a compile
    error at bucket 2's shapes, simulated) the bucket runs the fused forward from then on -
    the same outputs, the reason in fused_buckets - and bucket 1 keeps the megakernel. (The
    interpreter compiles nothing: there a failing launch is a bug and propagates, so the
    test takes the CUDA path's rule.)"""
    from photon_core.megakernel import megakernel_backend as mb
    from photon_core.megakernel.megakernel_step import MegakernelStep
    real = MegakernelStep.run_kernel
    tries = {1: 0, 2: 0}

    def failing_at_2(step, **kw):
        tries[step.b] += 1
        if step.b == 2:
            raise RuntimeError("PassManager::run failed")
        return real(step, **kw)
    monkeypatch.setattr(MegakernelStep, "run_kernel", failing_at_2)
    _, mk = _engines(fused, 2, spec="fma/w8")
    monkeypatch.setattr(mb, "interpreted", lambda: False)
    pairs = [(encs[j], TASKS[j]) for j in range(2)]
    for w, g in zip(fused.decode(2, pairs[:1]) + fused.decode(2, pairs),
                    _decode(mk, pairs[:1]) + _decode(mk, pairs)):
        assert same(w, g), (w.output, g.output)
    be = mk.state.backend
    assert be.fused_buckets[2].startswith("megakernel build failed: RuntimeError"), \
        be.fused_buckets
    assert tries[2] == 1 and tries[1] > 5 and 1 in be.steps and 2 not in be.steps
    mk.close()


@cpu_only
def test_a_failed_build_names_its_kept_reproducer(model, monkeypatch):
    """A build that fails while Triton wrote its reproducer (simulated: the file at
    TRITON_REPRODUCER_PATH, then an error) keeps the fused backend, and the reason names the
    file, which is still there; TRITON_REPRODUCER_PATH is unset again."""
    import glob
    from photon_core.megakernel import megakernel_backend as mb

    def failing_build(*a, **kw):
        open(os.environ["TRITON_REPRODUCER_PATH"] + ".make_ttgir.repro.mlir", "w").close()
        raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(mb, "MegakernelStep", failing_build)
    monkeypatch.delenv("TRITON_REPRODUCER_PATH", raising=False)
    fe = FastEngine(model, max_batch=1, fused="on", megakernel="off")
    be, why = mb.megakernel_backend(fe.state.fused, fe.state, "fma/w8")
    files = glob.glob(os.path.join(tempfile.gettempdir(), "photon_megakernel_*.repro.mlir"))
    try:
        assert be is None and why.startswith("megakernel build failed: RuntimeError"), why
        assert files and all(f in why for f in files), (why, files)
        assert "TRITON_REPRODUCER_PATH" not in os.environ
    finally:
        for f in files:
            os.remove(f)
        fe.close()


@cpu_only
def test_cancel_mid_flight_releases_the_zombie_row(fused, encs):
    fu, mk = _engines(fused, 2)
    t = Task("point", object="cup", max_objects=20)
    a = mk.start(encs[0], t, ignore_eos=True)
    b = mk.start(encs[1], Task("query", question="What?", max_tokens=30), ignore_eos=True)
    cancel_mid_flight(mk, a, b)
    res = a.result()
    assert res.finish_reason == "deadline" and res.output["points"]
    # the fused run of the same task, cut after twice the steps the cancelled run had (its
    # first points; the whole run is 40 steps, ~20 s interpreted)
    steps = iter(range(2 * res.tokens))
    ref = fu.run(encs[0], t, ignore_eos=True,
                 should_stop=lambda: None if next(steps, None) is not None else "deadline")
    ref = ref.output["points"]
    assert len(ref) > len(res.output["points"]), (ref, res.output)
    assert res.output["points"] == ref[:len(res.output["points"])]
    b.cancel()
    mk.close()


@cpu_only
def test_variant_option_is_validated_and_used(model, encs, fused):
    with pytest.raises(ValueError, match="unknown part"):
        EngineOptions(megakernel="small/w4/bogus")
    with pytest.raises(ValueError):
        EngineOptions(megakernel="nosuchgemv")
    mk = FastEngine(model, max_batch=1, fused="on", megakernel="small/w4/s2")
    assert mk.metrics()["megakernel"] == "small/w4/s2"
    assert mk.state.megakernel.step_for(1).gemv == "small"
    t = TASKS[0]        # (the fused reference: megakernel "off", as "auto" is on the CPU)
    assert same(fused.run(1, encs[0], t), mk.run(encs[0], t))
    mk.close()


@cpu_only
def test_auto_is_the_default_and_picks_by_gpu(model, monkeypatch):
    """EngineOptions.megakernel="auto": on the CPU (and under the interpreter) it resolves to
    "off" quietly - the fused backend serves, nothing is compiled; on a CUDA device it is
    "on" for a Hopper GPU (sm_90, where it was measured to win) and "off" for others."""
    from types import SimpleNamespace

    from photon_core.engine import EngineOptions
    from photon_core.megakernel import megakernel_backend as mb
    assert EngineOptions().megakernel == "auto"
    fe = FastEngine(model, max_batch=1, fused="on")
    assert fe.state.megakernel is None and fe.state.backend is fe.state.fused
    assert fe.metrics()["megakernel"] is None and fe.metrics()["megakernel_fallback"] == ""
    fe.close()
    assert mb.auto_spec(None) == "off"
    cuda_fd = SimpleNamespace(x=SimpleNamespace(device="cuda:0"))
    assert mb.auto_spec(cuda_fd) == "off"                # the interpreter: never
    monkeypatch.setattr(mb, "interpreted", lambda: False)
    for cap, want in (((9, 0), "on"), ((8, 0), "off"), ((10, 0), "off")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=cap: c)
        assert mb.auto_spec(cuda_fd) == want, cap
    assert mb.auto_spec(SimpleNamespace(x=SimpleNamespace(device="cpu"))) == "off"
    # "on" on CUDA: each lowering's measured best build (the hybrid kernel's own: Moondream's
    # programs per SM and attention splits would mis-set it)
    assert mb.resolve_variant("on") == Variant.parse(mb.BEST)
    assert mb.resolve_variant("on", hybrid=True) == Variant.parse(mb.HYBRID_BEST)
    assert mb.resolve_variant("on", hybrid=True) != mb.resolve_variant("on")


def test_deterministic_one_row_decoder_gemvs_take_the_megakernels_tiles():
    """What makes the megakernel's passes the fused deterministic step's bits (with the
    attention's splits merged in split order): deterministic mode's one-row picks for
    Moondream 2's decoder GEMVs ([qkv | fc1] + GELU, the residual [proj | fc2]) are FMA
    tiles of BEST's K step and warps, no split-K, at most 16 rows (at 1024 K and 4 warps
    tiles of 1-16 rows share one layout: the same sums as BEST's 8 rows), so each output is
    summed in the same order (BEST changed alone would fail this, as it would the tokens on
    the H200: test_gpu_deterministic_mode_decodes_the_fused_tokens_at_real_shapes). The
    default mode keeps its own picks."""
    from photon_core.megakernel import megakernel_backend as mb
    from photon_core.megakernel.lowering import parse_gemv
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.ops import gemv as G

    v = Variant.parse(mb.BEST)
    name, (rows, bk) = parse_gemv(v.gemv)
    assert name == "pipe_fma"
    t = MoondreamConfig().text
    qkv = (t.n_heads + 2 * t.n_kv_heads) * t.head_dim
    shapes = [(qkv + t.ff_dim, t.dim, G.EPI_QKV_GELU),
              (t.dim, t.n_heads * t.head_dim + t.ff_dim, G.EPI_RESIDUAL)]
    assert sorted(shapes) == sorted(G.MEGAKERNEL_ORDER_TILES)
    assert (rows, bk, v.warps) == (8, 1024, 4)      # (the layout finding is for these)
    for n, k, epi in shapes:
        c = G.pick(1, n, k, epi, deterministic=True)
        assert (c.block_k, c.split_k, c.num_warps, c.dot) == (bk, 1, v.warps, False), (n, k, c)
        assert 1 <= c.block_n <= 16
        assert c.fits(1, n, k, epi)
        assert G.pick(1, n, k, epi) != c and G.pick(2, n, k, epi, deterministic=True) != c


@cpu_only
def test_fallback_without_the_fused_backend_says_why(model, encs, caplog):
    with caplog.at_level(logging.WARNING, logger="photon_core.megakernel.megakernel_backend"):
        fe = FastEngine(model, max_batch=1, fused="off", megakernel="on")
    assert fe.state.megakernel is None and fe.state.backend is fe.state.eager
    why = fe.metrics()["megakernel_fallback"]
    assert "fused backend is off" in why and fe.metrics()["megakernel"] is None
    assert any("fused backend is off" in r.getMessage() for r in caplog.records)
    ref = model.run(encs[0], TASKS[2])
    assert same(ref, fe.run(encs[0], TASKS[2]))          # the eager path, serving as before
    fe.close()


def _hybrid_engines_agree(model, monkeypatch, batches, ignore_eos: bool = False) -> None:
    """A fused engine and one with the megakernel (a variant, not "on": "on" runs bucket 1
    only) on `model`; every batch of (image index, Task) pairs through both: the same runs
    (tokens, text, finish reasons); the megakernel launched at buckets 1 and 2 through the
    hybrid lowering; "auto" keeps it off for the family (not measured on a GPU yet)."""
    from photon_core.megakernel import megakernel_backend as mb
    from engine_runs import results_and_text, same_run
    launches = Launches(monkeypatch)
    mk = FastEngine(model, max_batch=2, kv_capacity=512, fused="on", megakernel="auto/w8/s3")
    assert isinstance(mk.state.backend, mb.MegakernelBackend), mk.state.megakernel_fallback
    assert mk.state.backend.step_for(1).hybrid
    fu = FastEngine(model, max_batch=2, kv_capacity=512, fused="on")
    rng = np.random.default_rng(3)
    encs = [model.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((96, 128), (64, 64))]
    for k, batch in enumerate(batches):
        pairs = [(encs[i], t) for i, t in batch]
        want = results_and_text(fu, pairs, ignore_eos=ignore_eos)
        got = results_and_text(mk, pairs, ignore_eos=ignore_eos)
        for w, g in zip(want, got):
            assert same_run(w, g), (k, w, g)
    assert launches.by_bucket.get(1) and launches.by_bucket.get(2), launches.by_bucket
    assert mb.auto_spec(mk.state.fused) == "off"
    fu.close(), mk.close()


SAMPLED = Task("query", question="Color?", temperature=0.8, top_p=0.9, seed=5, max_tokens=3)


@cpu_only
def test_qwen35_runs_through_the_hybrid_megakernel(tmp_path, monkeypatch):
    """Qwen 3.5 (Gated DeltaNet + gated attention): query, caption and a seeded sampled query
    at batch 1 and 2 give the fused backend's outputs through the hybrid megakernel.
    (Detect / point: the tiny random model writes 56 coordinate tokens, ~0.4 s per
    interpreted step each way; their sample pieces are the fused backend's in both engines,
    and the forward piece the megakernel runs is the same for every phase of Qwen 3.5 - so
    the caption rides in the batch of 2, as in the Gemma 4 test, not in a run of its own.)"""
    from photon_core.models import qwen3_5
    q = qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path / "q35", seed=5)))
    _hybrid_engines_agree(q, monkeypatch, [
        [(0, Task("query", question="How many dogs?", max_tokens=4))],
        [(1, Task("caption", caption_length="short", max_tokens=4)), (0, SAMPLED)]])


@cpu_only
def test_gemma4_runs_through_the_hybrid_megakernel(tmp_path, monkeypatch):
    """Gemma 4 (window attention over rings, KV sharing, sandwich norms, per-layer inputs -
    the projection run before the kernel, as the feedback): query / caption outputs and a
    seeded sampled query at batch 1 and 2 = the fused backend's (the 8-slot rings long
    wrapped by the image prefix; eos ignored: the runs reach their budgets)."""
    from photon_core.models import gemma4
    g = gemma4.load_model(str(gemma4.make_test_model(tmp_path / "g4", seed=5)))
    _hybrid_engines_agree(g, monkeypatch, [
        [(0, Task("query", question="How many dogs?", max_tokens=3))],
        [(1, Task("caption", caption_length="short", max_tokens=3)), (0, SAMPLED)]],
        ignore_eos=True)


@gpu_only
@pytest.mark.parametrize("variant", ["on", "pipe_same/w8/s4", "auto/w8/s3"])
def test_gpu_graphs_match_fused(variant):
    """On CUDA (graphs captured per bucket, cooperative launch): the tiny fp32 model's
    outputs with the megakernel equal the fused backend's, batch 1 and 2 with zombies."""
    torch.manual_seed(0)
    m = build_random_model(tiny_config(fast=True), eos_bias=TEST_EOS_BIAS["fast"], seed=0,
                           device="cuda", dtype="fp32")
    rng = np.random.default_rng(0)
    encs = [m.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((120, 160), (90, 200))]
    fu = FastEngine(m, max_batch=2, fused="on")
    mk = FastEngine(m, max_batch=2, fused="on", megakernel=variant)
    assert mk.state.megakernel is not None, mk.state.megakernel_fallback
    assert mk.runner.graphs, "graphs captured"
    for k in range(len(TASKS)):
        pairs = [(encs[(k + j) % 2], TASKS[(k + j) % len(TASKS)]) for j in range(2)]
        for w, g in zip(_decode(fu, pairs[:1]) + _decode(fu, pairs),
                        _decode(mk, pairs[:1]) + _decode(mk, pairs)):
            assert same(w, g), (variant, k, w.output, g.output)
    fu.close(), mk.close()


@gpu_only
@pytest.mark.parametrize("variant", HYBRID_VARIANTS)
def test_gpu_gemma4_hybrid_megakernel_matches_fused(tmp_path, variant):
    """On CUDA: tiny random fp32 Gemma 4 through the hybrid megakernel gives the fused
    backend's outputs, batch 1 and 2, query and caption, past the rings' size."""
    from photon_core.models import gemma4
    g = gemma4.load_model(str(gemma4.make_test_model(tmp_path / "g4", seed=5)),
                          device="cuda", dtype="fp32")
    fu = FastEngine(g, max_batch=2, kv_capacity=512, fused="on")
    mk = FastEngine(g, max_batch=2, kv_capacity=512, fused="on", megakernel=variant)
    assert mk.state.megakernel is not None, mk.state.megakernel_fallback
    rng = np.random.default_rng(3)
    encs = [g.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((96, 128), (64, 64))]
    tasks = [Task("query", question="How many dogs?", max_tokens=12),
             Task("caption", caption_length="short", max_tokens=10)]
    for k in range(len(tasks)):
        pairs = [(encs[(k + j) % 2], tasks[(k + j) % len(tasks)]) for j in range(2)]
        for w, r in zip(_decode(fu, pairs[:1]) + _decode(fu, pairs),
                        _decode(mk, pairs[:1]) + _decode(mk, pairs)):
            assert same(w, r), (k, w.output, r.output)
    fu.close(), mk.close()


@gpu_only
@pytest.mark.parametrize("variant", HYBRID_VARIANTS)
def test_gpu_qwen35_hybrid_megakernel_matches_fused(tmp_path, variant, dtype="fp32"):
    """On CUDA (cooperative launch, one program per SM, graphs per bucket): tiny random Qwen
    3.5 through the hybrid megakernel gives the fused backend's outputs, batch 1 and 2, every
    skill (fp32: exact products; bf16 sums in another order than the fused GEMVs' tiles, so
    greedy tokens may part on near ties: bench/ab_switch.py measures it at real shapes)."""
    from photon_core.models import qwen3_5
    q = qwen3_5.load_model(str(qwen3_5.make_test_model(tmp_path / "q35", seed=5)),
                           device="cuda", dtype=dtype)
    fu = FastEngine(q, max_batch=2, kv_capacity=512, fused="on")
    mk = FastEngine(q, max_batch=2, kv_capacity=512, fused="on", megakernel=variant)
    assert mk.state.megakernel is not None, mk.state.megakernel_fallback
    rng = np.random.default_rng(3)
    encs = [q.encode_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((96, 128), (64, 64))]
    tasks = [Task("query", question="How many dogs?", max_tokens=12),
             Task("detect", object="person", max_objects=2),
             Task("caption", caption_length="short", max_tokens=10),
             Task("point", object="cup", max_objects=2)]
    for k in range(len(tasks)):
        pairs = [(encs[(k + j) % 2], tasks[(k + j) % len(tasks)]) for j in range(2)]
        for w, g in zip(_decode(fu, pairs[:1]) + _decode(fu, pairs),
                        _decode(mk, pairs[:1]) + _decode(mk, pairs)):
            assert same(w, g), (dtype, k, w.output, g.output)
    fu.close(), mk.close()


@gpu_only
@pytest.mark.parametrize("b,gemv", [(1, "pipe_fma@16x32/w4/s3"), (4, "pipe@16x32/w4/s3"),
                                    (1, "pipe_fma@16x64/w4/s2")])
def test_gpu_pre_and_fill_give_the_same_bits(b, gemv):
    """On CUDA with two programs per SM (the waits real, the sm_90 build): `pre` (the
    first weight tiles issued before the wait) and `fill` (fc1 rows dealt out around
    attention, two key splits per attention instruction), `elide` (a program's repeated
    waits not polled again), `rpf` (the next record prefetched into L1), `early` (a
    block's bias and residual loaded at its first step), `poll1` (one thread polls, then
    a CTA barrier) and `tail` (the larger key-split groups last) give, launch after launch,
    the same bits as the plain build: each output row is still one instruction's, its
    products added in the same order (tiny model, bf16, 8 launches)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import test_megakernel as T
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd = T._setup(rows=4, b=b, device="cuda", dtype="bf16")
    s0 = T._snapshot(st, fd)
    runs = {}
    for extra in ("", "/pre", "/a2/fill", "/a2/fill/pre", "/a2/fill/pre/elide/rpf",
                  "/a2/fill/pre/elide/early/poll1",
                  "/a3/fill/pre/elide/early/poll1/tail"):
        T._restore(st, fd, s0)
        mk = MegakernelStep(fd, st, b, variant=f"{gemv}/p2{extra}")
        assert mk.compiled.n_programs > 1
        runs[extra] = []
        for _ in range(8):
            mk.run_kernel()
            runs[extra].append(T._snapshot(st, fd))
        assert int(mk.compiled.counters.abs().sum()) == 0
    for extra, snaps in runs.items():
        for k, (x, y) in enumerate(zip(runs[""], snaps)):
            for f in T.FIELDS:
                assert torch.equal(x[f], y[f]), (extra, k, f)


@cpu_only
def test_stopped_rows_skip_the_megakernel_with_the_same_outputs(fused, encs, monkeypatch):
    """megakernel_backend.SKIP_STOPPED: a row whose lm pick is its task's eos marks itself
    stopped (ops/row_stop.py) and the megakernel then skips the step's work (the eos
    step's and the zombie step's): every skill's outputs as the fused engine's; an eos-ended
    task leaves its row stopped, a task that ignores eos never marks it."""
    from photon_core.megakernel import megakernel_backend
    monkeypatch.setattr(megakernel_backend, "SKIP_STOPPED", True)
    _, mk = _engines(fused, 1)
    reasons = []
    for k, t in enumerate(TASKS[:3]):
        a, b = fused.run(1, encs[k % 2], t), mk.run(encs[k % 2], t)
        assert same(a, b), (t, a.output, b.output)
        reasons.append(b.finish_reason)
        assert mk.state.stopped[0].item() == (b.finish_reason == "stop"), t
    assert "stop" in reasons
    b = mk.run(encs[0], TASKS[2], ignore_eos=True)
    assert b.finish_reason == "length" and mk.state.stopped[0].item() == 0
    mk.close()


@gpu_only
def test_gpu_deterministic_mode_decodes_the_fused_tokens_at_real_shapes():
    """Issue 12's target at Moondream 2's real shapes (random bf16 weights, a 640x480 frame):
    in deterministic mode the megakernel engine ("on" = BEST at bucket 1) decodes every
    skill to the fused deterministic engine's outputs and token counts (whose decoder GEMVs
    take BEST's tiles at one row and whose attention merges its splits in split order, as
    the megakernel does) - query and caption 64 tokens, detect / point 5 objects, eos
    ignored so every run is full length."""
    from photon_core.megakernel import megakernel_backend as mb
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.model import build_random_model as build_real

    m = build_real(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    fu = FastEngine(m, max_batch=1, deterministic=True, megakernel="off")
    mk = FastEngine(m, max_batch=1, deterministic=True, megakernel="on")
    assert mk.state.megakernel is not None, mk.state.megakernel_fallback
    assert mk.state.megakernel.variant == Variant.parse(mb.BEST)
    enc = fu.encode_image(frame)
    tasks = [Task("query", question="What is in the image?", max_tokens=64),
             Task("caption", caption_length="normal", max_tokens=64),
             Task("detect", object="person", max_objects=5),
             Task("point", object="cup", max_objects=5)]
    for t in tasks:
        (want,), (got,) = (run_to_end(fe, [(enc, t)], ignore_eos=True) for fe in (fu, mk))
        want, got = want.result(), got.result()
        if t.skill in ("query", "caption"):
            assert want.tokens == 64, (t.skill, want.tokens)
        assert same(want, got), (t.skill, want.output, got.output)
    fu.close(), mk.close()
