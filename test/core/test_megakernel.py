"""The megakernel backend (photon_core/megakernel) on the CPU: the compiler's schedule, the
Python twin (python_vm.py) and the persistent kernel (kernel.py, TRITON_INTERPRET=1, one
program) against the fused backend's step (fast/fused_backend.py), field by field, on the
tiny fp32 model. The H200 check at full size in bf16: bench/bench_megakernel.py."""
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

FIELDS = ("x", "hidden", "logits", "out", "pos", "phase", "first", "kv")


def _setup(rows=2, b=2, seed=0, chunk=16, device="cpu", dtype="fp32"):
    """The tiny model's StepState with a fused backend (deterministic, attention chunks of
    `chunk` keys: 4 splits over the 64-position cache), rows [0, b) active at different
    positions and phases; fp32 on the CPU (the tests), or another device / dtype (the same
    random state drawn on the CPU: the GPU check of the pre flag in the session report)."""
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds
    from photon_core.fast.fused_backend import FusedBackend
    from photon_core.fast.static_kv_cache import StaticKVCache
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    from photon_core.dtype_names import parse_dtype

    m = build_random_model(tiny_config(fast=True), device=device, dtype=dtype, seed=seed)
    cfg = m.config.text
    kv = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, rows, 64, cfg.head_dim, device,
                       parse_dtype(dtype))
    g = torch.Generator().manual_seed(seed + 1)

    def normal_(t):
        if t.device.type == "cpu":
            t.normal_(generator=g)
        else:
            t.copy_(torch.empty(t.shape).normal_(generator=g))

    normal_(kv.data)
    st = ds.StepState(m, rows, kv, EngineOptions(fused="off"))
    fd = FusedBackend(st.spec, st.w, kv, rows, attn_chunk=chunk, deterministic=True)
    st.fused = st.backend = fd
    st.pos[:b] = torch.tensor([5, 40, 63, 12][:b])
    st.active[:b] = True
    st.first[:b] = torch.tensor([True, False, False, True][:b])
    st.phase[:b] = torch.tensor([0, 2, 1, 0][:b])
    st.kind[:b] = torch.tensor([0, 1, 1, 0][:b])
    normal_(st.hidden)
    normal_(fd.x)
    return m, st, fd


def _snapshot(st, fd):
    return {"x": fd.x.clone(), "hidden": st.hidden.clone(),
            "logits": fd.bufs["logits"].clone(), "out": st.out.clone(), "pos": st.pos.clone(),
            "phase": st.phase.clone(), "first": st.first.clone(), "kv": fd.kv.data.clone(),
            "active": st.active.clone()}


def _restore(st, fd, s):
    fd.x.copy_(s["x"]), st.hidden.copy_(s["hidden"]), fd.bufs["logits"].copy_(s["logits"])
    st.out.copy_(s["out"]), st.pos.copy_(s["pos"]), st.phase.copy_(s["phase"])
    st.first.copy_(s["first"]), fd.kv.data.copy_(s["kv"]), st.active.copy_(s["active"])


def _fused_step(m, st, fd, b):
    from photon_core.megakernel.megakernel_step import reference_step
    reference_step(fd, st, b, feed=False)


def _close_rows(got, want, b):
    """Every snapshot field close (_close): the bucket's b rows, the whole k/v cache."""
    for f in FIELDS:
        sl = slice(None) if f == "kv" else slice(0, b)
        _close(f, got[f][sl], want[f][sl])


def _second_launch_matches_fused(mk, m, st, fd, b):
    """A second launch of the same compiled kernel (counters reset by the first), from the
    state the first left, equals the fused step from that state."""
    after = _snapshot(st, fd)
    mk.run_kernel()
    got2 = _snapshot(st, fd)
    _restore(st, fd, after)
    _fused_step(m, st, fd, b)
    _close_rows(got2, _snapshot(st, fd), b)


_FUSED_REFS: dict = {}        # b -> (s0, ref): _setup() draws the same state every time


def _with_fused_reference(b: int):
    """_setup()'s state s0 and the fused step's result from it (ref), the state restored
    to s0: (m, st, fd, s0, ref). (The fused step, deterministic, runs once per bucket in
    the module - ~1 s interpreted, a dozen tests take it; s0 is asserted to be the state it
    ran from.)"""
    m, st, fd = _setup()
    s0 = _snapshot(st, fd)
    if b not in _FUSED_REFS:
        _fused_step(m, st, fd, b)
        _FUSED_REFS[b] = (s0, _snapshot(st, fd))
        _restore(st, fd, s0)
    was, ref = _FUSED_REFS[b]
    for f in s0:
        assert torch.equal(s0[f], was[f]), f
    return m, st, fd, s0, ref


def _launch_both_ways(mk, st, fd, s0, flag: str) -> dict:
    """One launch from state s0 with the kernel flag off and one with it on (the counters
    reset after each): their snapshots, asserted the same bits field by field."""
    results = {}
    for on in (False, True):
        _restore(st, fd, s0)
        mk.run_kernel(**{flag: on})
        assert int(mk.compiled.counters.abs().sum()) == 0
        results[on] = _snapshot(st, fd)
    for f in FIELDS:
        assert torch.equal(results[True][f], results[False][f]), (flag, f)
    return results


def _close(name, a, b, tol=2e-4):
    assert a.shape == b.shape, name
    if a.dtype in (torch.int64, torch.bool, torch.uint8):
        assert torch.equal(a, b), (name, a, b)
        return
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * (1 + b.float().abs().max().item()), (name, err)


def test_compiler_schedule_covers_every_tile_in_topological_queues():
    from photon_core.megakernel.instructions import N_FIELDS, OP_GEMV_W1
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd = _setup()
    mk = MegakernelStep(fd, st, 2, n_sm=5)
    c = mk.compiled
    assert 1 < c.n_programs <= 5
    assert c.table.shape == (len(c.instrs), N_FIELDS)
    for q in c.queues():                   # each queue in topological order
        idx = [i.index for i in q]
        assert idx == sorted(idx)
    # the two W1 ops of layer 0 tile rows [0, n1) exactly once
    rows = sorted(i.tile for i in c.instrs if i.op == OP_GEMV_W1 and i.op_name.endswith(".0"))
    assert rows[0][0] == 0 and rows[-1][1] == mk.low.layers[0]["w1"]["w"].shape[0]
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    # attention: each (row, head) of a layer covers the key splits [0, NSPLIT) exactly once,
    # its instructions know how many they are (the last to finish merges)
    ns = mk.low.shape["NSPLIT"]
    assert ns == 4
    for r in range(2):
        for h in range(mk.low.shape["NH"]):
            mine = [i for i in c.instrs if i.op_name == "attn.0" and i.tile == (r, h)]
            subs = sorted(i.sub for i in mine)
            assert subs[0][0] == 0 and subs[-1][1] == ns
            assert all(a[1] == b[0] for a, b in zip(subs, subs[1:]))
            assert all(i.n_sub == len(mine) for i in mine)
    # three stages per layer: the W1 GEMVs (LayerNorm fused) wait for the previous W2 only
    assert {i.op_name.split(".")[0] for i in c.instrs} == {"w1qkv", "w1fc1", "attn", "w2",
                                                           "advance", "lm", "argmax"}
    names = [op.name for op in c.ops]
    w1 = next(i for i in c.instrs if i.op_name == "w1qkv.1")
    assert [names[w] for w, _ in w1.waits] == ["w2.0"] and "ln_inp" in w1.args
    # GEMVs with a fused LayerNorm read their own program's rows of the scratch
    from photon_core.megakernel.instructions import F_A
    hs = c.offsets["hs"]
    d, rows = mk.low.shape["D"], 2
    for k, ins in enumerate(c.instrs):
        if "ln_inp" in ins.args:
            assert int(c.table[k, F_A]) == hs + ins.sm * rows * d
    _check_ln_reuse_and_waits(c)
    assert c.makespan_us > 0


def _check_ln_reuse_and_waits(c, reuse=True):
    """A GEMV reuses its program's LayerNorm scratch only right after an instruction of the
    same queue that computed the same LayerNorm (operands and waits; attention instructions
    in between write neither x nor the scratch); the table says so. Every wait targets the
    producer op's full instruction count."""
    from photon_core.megakernel.compiler import ln_key
    from photon_core.megakernel.instructions import F_P7, OP_ATTN
    n_reuse = 0
    for q in c.queues():
        q = [i for i in q if i.op != OP_ATTN]
        for prev, ins in zip([None] + q[:-1], q):
            if ins.ln_reuse:
                n_reuse += 1
                assert prev is not None and ln_key(prev) == ln_key(ins) is not None
    assert (n_reuse > 0) == reuse
    for k, ins in enumerate(c.instrs):
        if "ln_inp" in ins.args:
            assert (int(c.table[k, F_P7]) == -1) == ins.ln_reuse
    count = {}
    for i in c.instrs:
        count[i.signal] = count.get(i.signal, 0) + 1
    for i in c.instrs:
        for w, t in i.waits:
            assert count[w] == t


def test_fill_schedules_cost_instructions_with_the_fitted_constants():
    """Fill schedules (the "on" build) price an instruction with the constants fitted to the
    H200 trace (FILL_SM_BYTES_PER_US, FILL_INSTR_US, ATTN_LATENCY_US), the others with the
    copy-bandwidth share and INSTR_US: a W2 tile costs bytes / rate + the fixed cost."""
    from photon_core.megakernel import compiler as C
    from photon_core.megakernel.instructions import OP_ATTN, OP_GEMV_W2
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd, s0, ref = _with_fused_reference(1)
    for variant, bw, fixed in (("auto/a4/fill", C.FILL_SM_BYTES_PER_US, C.FILL_INSTR_US),
                               ("auto/a4", C.SM_BYTES_PER_US, C.INSTR_US)):
        mk = MegakernelStep(fd, st, 1, n_sm=12, variant=variant)
        sh, el = mk.low.shape, fd.x.element_size()
        w2 = next(i for i in mk.compiled.instrs if i.op == OP_GEMV_W2)
        want = (w2.tile[1] - w2.tile[0]) * sh["KW2"] * el / bw + fixed
        assert w2.cost == pytest.approx(want), (variant, w2.cost, want)
        att = next(i for i in mk.compiled.instrs if i.op == OP_ATTN)
        kv = 2 * sh["CHUNK"] * sh["HD"] * el
        want = ((att.sub[1] - att.sub[0]) * kv / bw + fixed + sh["NSPLIT"] * (sh["HD"] + 2) * 4
                / bw + (C.ATTN_LATENCY_US if "fill" in variant else 0.0))
        assert att.cost == pytest.approx(want), (variant, att.cost, want)


def test_fill_schedule_deals_fc1_rows_around_attention():
    """fill: each layer's fc1 rows (the GEMV beside attention) come after attention in the
    program order and go to the programs by their free time: they cover the rows once, in
    one instruction of consecutive rows per program, the programs holding attention get
    fewer rows than the others; the queues stay topological, the LayerNorm is reused across
    the attention instruction, the waits count the merged tiles. The Python twin gives the
    fused step's fields, and one interpreted program the same bits as without fill."""
    from photon_core.megakernel.instructions import OP_ATTN
    from photon_core.megakernel.megakernel_step import MegakernelStep

    b = 2
    m, st, fd, s0, ref = _with_fused_reference(b)
    c = MegakernelStep(fd, st, b, n_sm=12, variant="auto/a4/fill").compiled
    names = [op.name for op in c.ops]
    assert names.index("attn.0") < names.index("w1fc1.0") < names.index("w2.0")
    for q in c.queues():
        idx = [i.index for i in q]
        assert idx == sorted(idx)
    _check_ln_reuse_and_waits(c, reuse=False)     # (12 programs: no queue holds qkv and fc1)
    # 3 programs: fc1 after attention in a queue reuses the LayerNorm of the qkv tile
    c3 = MegakernelStep(fd, st, b, n_sm=3, variant="auto/a4/fill").compiled
    _check_ln_reuse_and_waits(c3)
    assert any(p.op == OP_ATTN and i.ln_reuse for q in c3.queues() for p, i in zip(q, q[1:]))
    n_split = fd.fused_gemvs[next(op for op in fd.program.ops if op.kind == "linear")]
    lo, hi = n_split["n_split"], n_split["w"].shape[0]
    for layer in range(2):
        fc1 = sorted((i.tile, i.sm) for i in c.instrs if i.op_name == f"w1fc1.{layer}")
        assert fc1[0][0][0] == lo and fc1[-1][0][1] == hi
        assert all(a[0][1] == b_[0][0] for a, b_ in zip(fc1, fc1[1:]))
        assert len({sm for _, sm in fc1}) == len(fc1)         # one instruction per program
        attn = {i.sm for i in c.instrs if i.op_name == f"attn.{layer}"}
        rows = {sm: t[1] - t[0] for t, sm in fc1}
        with_attn = [rows.get(p, 0) for p in range(c.n_programs) if p in attn]
        without = [rows.get(p, 0) for p in range(c.n_programs) if p not in attn]
        assert with_attn and without and max(with_attn) < max(without)
    for n_sm in (3, 12):
        _restore(st, fd, s0)
        MegakernelStep(fd, st, b, n_sm=n_sm, variant="auto/a4/fill").run_vm()
        _close_rows(_snapshot(st, fd), ref, b)
    got = {}
    for variant in ("auto/a2", "auto/a2/fill"):
        _restore(st, fd, s0)
        MegakernelStep(fd, st, b, variant=variant).run_kernel()
        got[variant] = _snapshot(st, fd)
    _close_rows(got["auto/a2/fill"], ref, b)
    for f in FIELDS:
        assert torch.equal(got["auto/a2"][f], got["auto/a2/fill"][f]), f


def test_python_vm_matches_fused_step_and_detects_a_bad_schedule():
    from photon_core.megakernel.megakernel_step import MegakernelStep
    from photon_core.megakernel.python_vm import Deadlock, PythonVM

    b = 2
    m, st, fd, s0, ref = _with_fused_reference(b)
    results = []
    for n_sm in (1, 7):                    # the result does not depend on the schedule
        _restore(st, fd, s0)
        mk = MegakernelStep(fd, st, b, n_sm=n_sm)
        mk.run_vm()
        got = _snapshot(st, fd)
        _close_rows(got, ref, b)
        results.append(got)
    for f in FIELDS:
        assert torch.equal(results[0][f], results[1][f]), f
    # a queue whose order breaks a dependency cannot run: the VM says so
    c = MegakernelStep(fd, st, b, n_sm=1).compiled
    c.instrs[0], c.instrs[1] = c.instrs[1], c.instrs[0]   # w1 tile before its layernorm
    c.instrs.insert(0, c.instrs.pop(next(k for k, i in enumerate(c.instrs) if i.waits)))
    with pytest.raises(Deadlock):
        PythonVM(c, MegakernelStep(fd, st, b, n_sm=1).low).run()


@pytest.mark.parametrize("b,attn_per,base", [(1, None, "low"), (2, None, "high"),
                                             (2, 1, "low"), (2, 3, "high")])
def test_megakernel_matches_vm_and_fused_step(b, attn_per, base):
    """One persistent program runs the whole instruction list (the interpreter runs programs
    one after another): hidden state, logits, token, k/v, position/phase/first vs the fused
    backend's feed-less step and vs the Python twin; a second launch works (the kernel reset
    its counters). attn_per: key splits per attention instruction (None: all 4 of a head; 1, 3:
a head's splits over several instructions, the last to finish merging them). base: each
dtype arena's base tensor is its lowest ("low": every operand offset >= 0) or its highest
("high": every other offset negative) buffer."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd, s0, ref = _with_fused_reference(b)
    from photon_core.megakernel.compiler import compile_program

    mk = MegakernelStep(fd, st, b, attn_per=attn_per)
    bufs = dict(sorted(mk.low.buffers.items(), key=lambda kv: kv[1].data_ptr(),
                       reverse=base == "high"))
    mk.compiled = compile_program(mk.low.ops, bufs, b, mk.low.shape, mk.low.gemv_cfg, 1,
                                  torch.float32, attn_per)
    offs = list(mk.compiled.offsets.values())
    assert min(offs) < 0 if base == "high" else min(offs) >= 0
    assert mk.compiled.n_programs == 1
    mk.run_vm()
    vm = _snapshot(st, fd)
    _restore(st, fd, s0)
    mk.run_kernel()
    got = _snapshot(st, fd)
    assert int(mk.compiled.counters.abs().sum()) == 0      # reset for the next launch
    _close_rows(got, ref, b)
    _close_rows(got, vm, b)
    assert torch.equal(got["x"][b:], s0["x"][b:])          # rows outside the bucket untouched
    # a second step through the same compiled kernel: still equal to the fused backend
    _second_launch_matches_fused(mk, m, st, fd, b)


@pytest.mark.parametrize("dot", [True, False])
def test_gemv_unroll_gives_the_same_bits(dot):
    """The GEMV W-tile unroll (2, 4 tiles loaded before the first is used) adds the products
    in the plain loop's order: the same bits as unroll 1, and the Python twin's values;
    K / BLOCK_K = 4 (W1, lm) and 12 (W2) trips. dot=False: the b=1 FMA form."""
    from photon_core.megakernel.compiler import compile_program
    from photon_core.megakernel.instructions import OP_GEMV_LM, OP_GEMV_W1, OP_GEMV_W2
    from photon_core.megakernel.kernel import kernel_args
    from photon_core.megakernel.megakernel_step import MegakernelStep
    from photon_core.ops.gemv import GemvConfig

    m, st, fd = _setup()
    b = 2 if dot else 1
    s0 = _snapshot(st, fd)
    mk = MegakernelStep(fd, st, b)
    cfg = GemvConfig(16, 32, 1, 4, 1, dot)
    mk.low.gemv_cfg = {OP_GEMV_W1: cfg, OP_GEMV_W2: cfg, OP_GEMV_LM: cfg}
    mk.compiled = compile_program(mk.low.ops, mk.low.buffers, b, mk.low.shape,
                                  mk.low.gemv_cfg, 1, torch.float32)
    mk.run_vm()
    vm = _snapshot(st, fd)
    results = {}
    for un in (1, 2, 4):
        _restore(st, fd, s0)
        kw = kernel_args(mk.compiled, mk.low, un)[1]
        assert kw["W1_UN"] == un and kw["W2_UN"] == un and kw["LM_UN"] == un
        mk.run_kernel(unroll=un)
        results[un] = _snapshot(st, fd)
        _close_rows(results[un], vm, b)
    for un in (2, 4):
        for f in FIELDS:
            assert torch.equal(results[un][f], results[1][f]), (un, f)


def test_split_groups_cover_the_splits_with_the_larger_groups_last():
    """compiler.split_groups: ceil(ns / per) contiguous groups covering [0, ns) either way;
    the plain form `per` splits from the first, the tail form sizes within one of each
    other, never decreasing (7 at 3: 3 + 3 + 1 -> 2 + 2 + 3)."""
    from photon_core.megakernel.compiler import split_groups

    assert split_groups(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert split_groups(7, 3, tail=True) == [(0, 2), (2, 4), (4, 7)]
    assert split_groups(8, 3, tail=True) == [(0, 2), (2, 5), (5, 8)]
    assert split_groups(4, 3, tail=True) == [(0, 2), (2, 4)]
    for ns in range(1, 13):
        for per in range(1, ns + 1):
            for tail in (False, True):
                g = split_groups(ns, per, tail)
                assert len(g) == -(-ns // per)
                assert g[0][0] == 0 and g[-1][1] == ns
                assert all(a[1] == b[0] for a, b in zip(g, g[1:]))
                sizes = [s1 - s0 for s0, s1 in g]
                assert min(sizes) >= 1 and max(sizes) <= per
                if tail:
                    assert sizes == sorted(sizes) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("b", [1, 2])
def test_attention_groups_with_the_larger_ones_last_give_the_same_bits(b):
    """tail (split_groups): a head's 4 key splits as 2 + 2 instead of 3 + 1 per attention
    instruction - each split's partials and the merge over all splits do not depend on the
    grouping: the same bits as the plain build, and the Python twin's values."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd = _setup()
    s0 = _snapshot(st, fd)
    got = {}
    for variant in ("auto/a3", "auto/a3/tail"):
        mk = MegakernelStep(fd, st, b, variant=variant)
        sizes = sorted(i.sub[1] - i.sub[0] for i in mk.compiled.instrs
                       if i.op_name == "attn.0" and i.tile[0] == 0 and i.tile[1] == 0)
        assert sizes == ([2, 2] if variant.endswith("tail") else [1, 3])
        _restore(st, fd, s0)
        mk.run_vm()
        vm = _snapshot(st, fd)
        _restore(st, fd, s0)
        mk.run_kernel()
        assert int(mk.compiled.counters.abs().sum()) == 0
        got[variant] = _snapshot(st, fd)
        _close_rows(got[variant], vm, b)
    for f in FIELDS:
        assert torch.equal(got["auto/a3"][f], got["auto/a3/tail"][f]), f


@pytest.mark.parametrize("gemv,b,stages", [("pipe@16x32", 2, 3), ("pipe_fma@16x32", 1, 4),
                                           ("pipe@16x64", 1, 2), ("pipe_same", 1, 3)])
def test_pipelined_gemv_stream_matches_vm_and_fused_step(gemv, b, stages):
    """kernel._gemv_pipe (every GEMV instruction as one software-pipelined loop over its
    (row block, K tile) steps, the epilogue at each block's last K tile): the same fields as
    the fused step and the Python twin, two launches in a row; row blocks that end inside
    the tile (vocab 486 = 30 x 16 + 6) are masked."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd, s0, ref = _with_fused_reference(b)
    mk = MegakernelStep(fd, st, b, variant=f"{gemv}/w4/s{stages}")
    assert mk.low.pipe
    mk.run_vm()
    vm = _snapshot(st, fd)
    _restore(st, fd, s0)
    mk.run_kernel()
    got = _snapshot(st, fd)
    assert int(mk.compiled.counters.abs().sum()) == 0
    _close_rows(got, ref, b)
    _close_rows(got, vm, b)
    _second_launch_matches_fused(mk, m, st, fd, b)


def test_pipe_same_is_bitwise_the_fused_deterministic_step():
    """pipe_same (the fused deterministic path's own GEMV tiles, as pipelined streams) with
    "on"'s pre / early: every field of one step the same bits as the fused deterministic
    step under the interpreter (fp32), where another tile shape is not; on the H200 one pass
    is bitwise too, and a later one parts inside a layer (docs/benchmarks.md session 36
    calls 13-15: a difference of compiled code, which the interpreter cannot show)."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    b = 1
    m, st, fd, s0, ref = _with_fused_reference(b)
    results = {}
    for v in ("pipe_same/w4/s3/pre/early", "pipe_fma@16x32/w4/s3/pre/early"):
        _restore(st, fd, s0)
        MegakernelStep(fd, st, b, variant=v).run_kernel()
        results[v] = _snapshot(st, fd)
    same = results["pipe_same/w4/s3/pre/early"]
    for f in FIELDS:
        sl = slice(None) if f == "kv" else slice(0, b)
        assert torch.equal(same[f][sl], ref[f][sl]), f
    assert not torch.equal(results["pipe_fma@16x32/w4/s3/pre/early"]["x"][:b], ref["x"][:b])


@pytest.mark.parametrize("gemv,b,stages", [("pipe_fma@16x32", 1, 3), ("pipe@16x32", 2, 3),
                                           ("pipe_fma@16x64", 1, 2), ("pipe@16x64", 2, 4)])
def test_pipelined_gemv_waiting_in_its_first_step_gives_the_same_bits(gemv, b, stages):
    """pre (kernel._gemv_pipe PRE: the GEMV instruction's waits and fused LayerNorm run
    inside the pipelined loop's first step, after its weight load; step 0's activations
    are loaded there): every field the same bits as the build without it (FMA tiles at b=1,
    tl.dot tiles at b>1; K / BK = 4 or 2 steps per row block, 2-4 stages), the Python
    twin's and the fused step's values, two launches in a row. (The interpreter runs one
    program, so its waits are always met; what this catches is the order inside step 0:
    step 0's activations loaded before the LayerNorm wrote them change the values.)"""
    from photon_core.megakernel.kernel import kernel_args
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd, s0, ref = _with_fused_reference(b)
    mk = MegakernelStep(fd, st, b, variant=f"{gemv}/w4/s{stages}/pre")
    assert mk.variant.pre and mk.low.pipe
    assert kernel_args(mk.compiled, mk.low, pre=True)[1]["PRE"] is True
    assert kernel_args(mk.compiled, mk.low)[1]["PRE"] is False
    # every GEMV tile has rows (the kernel's step 0, where a pre instruction waits, runs)
    assert all(i.tile[1] > i.tile[0] for i in mk.compiled.instrs if i.op <= 2)
    mk.run_vm()
    vm = _snapshot(st, fd)
    results = _launch_both_ways(mk, st, fd, s0, "pre")
    _close_rows(results[True], ref, b)
    _close_rows(results[True], vm, b)
    _second_launch_matches_fused(mk, m, st, fd, b)      # (the variant's pre: on)


@pytest.mark.parametrize("gemv,b", [("pipe_fma@16x32/w4/s3/pre", 1)])
def test_epilogue_operands_loaded_early_give_the_same_bits(gemv, b):
    """early (kernel._gemv_pipe EARLY: a row block's bias and W2's residual rows loaded at
    its first K step, the epilogue adding what was loaded): every field the same bits as the
    build that loads them in the epilogue, and the fused step's values, launch after
    launch (the "on" build's form: FMA tiles at b=1 with pre)."""
    from photon_core.megakernel.kernel import kernel_args
    from photon_core.megakernel.megakernel_step import MegakernelStep, Variant

    m, st, fd, s0, ref = _with_fused_reference(b)
    mk = MegakernelStep(fd, st, b, variant=f"{gemv}/early")
    assert mk.variant.early and Variant.parse(str(mk.variant)) == mk.variant
    assert kernel_args(mk.compiled, mk.low, early=True)[1]["EARLY"] is True
    results = _launch_both_ways(mk, st, fd, s0, "early")
    _close_rows(results[True], ref, b)
    _second_launch_matches_fused(mk, m, st, fd, b)      # (the variant's early: on)


def _check_polled_waits(c, elided: bool = True) -> int:
    """compiler.elide_waits' rule, from the table: each instruction polls (fields 11..14)
    exactly the waits of its own that no earlier instruction of its queue made (counter and
    target; elided=False: all its waits); every wait it dropped is such an earlier one.
    Returns the waits dropped."""
    from photon_core.megakernel.compiler import CNT_STRIDE
    from photon_core.megakernel.instructions import F_TGT0, F_TGT1, F_WAIT0, F_WAIT1, NO_WAIT
    dropped, k = 0, 0
    for q in c.queues():
        seen = set()
        for ins in q:
            row = c.table[k]
            k += 1
            polled = {(int(row[w]) // CNT_STRIDE, int(row[t])) for w, t in
                      ((F_WAIT0, F_TGT0), (F_WAIT1, F_TGT1)) if int(row[w]) != NO_WAIT}
            assert polled == {w for w in ins.waits if not (elided and w in seen)}, ins.op_name
            dropped += len(ins.waits) - len(polled)
            seen.update(ins.waits)
    return dropped


@pytest.mark.parametrize("variant,b", [("pipe_fma@16x32/w4/s3/pre", 1), ("auto", 2)])
def test_elided_waits_give_the_same_bits(variant, b):
    """elide (compiler.elide_waits): an instruction polls only the counters its program has
    not already acquired at that target (a GEMV reusing its program's LayerNorm waits as the
    one that computed it): the table says so, and the kernel gives the same bits as the
    build that polls every wait, launch after launch (one program here: every repeated wait
    of the queue is dropped)."""
    from photon_core.megakernel.compiler import compile_program
    from photon_core.megakernel.megakernel_step import MegakernelStep, Variant

    m, st, fd, s0, ref = _with_fused_reference(b)
    mk = MegakernelStep(fd, st, b, variant=variant + "/elide")
    assert mk.variant.elide and Variant.parse(str(mk.variant)) == mk.variant
    assert _check_polled_waits(mk.compiled) > 0
    full = compile_program(mk.low.ops, mk.low.buffers, b, mk.low.shape, mk.low.gemv_cfg, 1,
                           torch.float32)
    assert _check_polled_waits(full, elided=False) == 0
    assert [i.waits for i in full.instrs] == [i.waits for i in mk.compiled.instrs]
    mk.run_kernel()
    got = _snapshot(st, fd)
    assert int(mk.compiled.counters.abs().sum()) == 0
    elided, mk.compiled = mk.compiled, full
    _restore(st, fd, s0)
    mk.run_kernel()
    for f in FIELDS:
        assert torch.equal(got[f], _snapshot(st, fd)[f]), f
    _close_rows(got, ref, b)
    mk.compiled = elided
    _second_launch_matches_fused(mk, m, st, fd, b)


def test_schedule_spreads_each_op_over_the_sms():
    """The scheduler gives an op's instructions to distinct SMs before any SM gets a second
    one; the plain earliest-free rule (removed) stacked short instructions that became ready
    while the other SMs were busy on one SM (H200, b=1: up to 5 attention instructions of a
    layer on one program, 120 of 3072 in all) - here it would put all four on SM 3."""
    from photon_core.megakernel.compiler import schedule
    from photon_core.megakernel.instructions import OP_ATTN, OP_GEMV_W1, Instr

    def program():
        ins = [Instr(OP_GEMV_W1, "qkv", (t, t + 1), {}, {}, (), 0, 1.0) for t in range(4)]
        ins += [Instr(OP_GEMV_W1, "fc1", (t, t + 1), {}, {}, (), 1, 10.0) for t in range(3)]
        ins += [Instr(OP_ATTN, "attn", (0, h), {}, {}, ((0, 4),), 2, 2.0) for h in range(4)]
        return ins

    placed = program()
    schedule(placed, 4)
    assert sorted(i.sm for i in placed if i.op == OP_ATTN) == [0, 1, 2, 3]
    for ins in placed:        # the same dependencies: nothing starts before what it waits for
        for w, _ in ins.waits:
            assert ins.start >= max(j.end for j in placed if j.signal == w)
    # the tiny model: every op's instructions over the 5 SMs, at most one more on any SM
    from photon_core.megakernel.megakernel_step import MegakernelStep
    m, st, fd = _setup()
    c = MegakernelStep(fd, st, 2, n_sm=5, variant="auto").compiled
    worst = 0
    for op in range(len(c.ops)):
        per = [sum(i.signal == op for i in q) for q in c.queues()]
        worst = max(worst, max(per) - min(per))
    assert worst <= 1, worst


def test_variant_strings_and_alignment_flag():
    """Variant strings round-trip; the kernel's 16-element alignment hints are on only when
    every hinted offset of the table is a multiple of 16 (one odd operand turns them off)."""
    from photon_core.megakernel.compiler import compile_program
    from photon_core.megakernel.instructions import Operand
    from photon_core.megakernel.lowering import Unsupported, gemv_configs
    from photon_core.megakernel.megakernel_step import MegakernelStep, Variant

    v = Variant.parse("pipe_fma@16x512/w8/s4/u2")
    assert (v.gemv, v.warps, v.stages, v.unroll, v.align) == ("pipe_fma@16x512", 8, 4, 2, True)
    assert Variant.parse(str(v)) == v
    assert not Variant.parse("fma/u4/noalign").align
    g = Variant.parse("pipe@16x512/w4/a4/hoist/p2/fill")
    assert (g.attn_per, g.warps, g.per_sm, g.fill) == (4, 4, 2, True)
    assert Variant.parse(str(g)) == g
    with pytest.raises(ValueError):
        Variant.parse("pipe/x3")
    p = Variant.parse("pipe_fma@8x1024/w4/s3/p2/pre")
    assert (p.pre, p.per_sm, p.stages) == (True, 2, 3) and not Variant.parse("pipe/w4").pre
    assert str(p) == "pipe_fma@8x1024/w4/s3/p2/pre" and Variant.parse(str(p)) == p
    assert Variant.parse("pipe@32x512/pre/w4/p2") == Variant.parse("pipe@32x512/w4/p2/pre")
    q = Variant.parse("pipe_fma@8x1024/w4/early/poll1/elide/rpf")
    assert (q.early, q.poll1, q.elide, q.rpf) == (True,) * 4 and Variant.parse(str(q)) == q
    for bad in ("fma/w8/pre", "auto/pre", "small/pre"):     # pre: pipe* GEMVs only
        with pytest.raises(ValueError):
            Variant.parse(bad)
    with pytest.raises(Unsupported):      # K = 100 is no multiple of 64
        gemv_configs(1, 640, 100, 384, 486, 384, "pipe@16x64")
    from photon_core.megakernel.instructions import F_A, F_B, F_W, F_Y

    m, st, fd = _setup()
    mk = MegakernelStep(fd, st, 2)
    t = mk.compiled.table
    # (CPU allocations are not always 16-element aligned: the flag follows the table)
    from photon_core.megakernel.instructions import F_OP
    hinted = t[t[:, F_OP] <= 3][:, [F_A, F_W, F_B, F_Y]]      # GEMV and attention rows
    assert not mk.compiled.aligned or bool((hinted % 16 == 0).all())
    ops = list(mk.low.ops)
    k = next(i for i, op in enumerate(ops) if op.name == "attn.0")
    a = dict(ops[k].args)
    a["out"] = Operand(a["out"].buf, a["out"].offset + 3)
    ops[k] = type(ops[k])(**{**ops[k].__dict__, "args": a})
    c = compile_program(ops, mk.low.buffers, 2, mk.low.shape, mk.low.gemv_cfg, 1,
                        torch.float32)
    assert not c.aligned


def test_removed_variant_parts_are_unknown():
    """The parts measured no better and removed (session 39, docs/dropped_experiments.md)
    are unknown parts now, like any other; the builds in use still parse and round-trip."""
    from photon_core.megakernel.megakernel_backend import BEST, HYBRID_BEST
    from photon_core.megakernel.megakernel_step import Variant

    for part in ("kv2", "pf32", "pfn64", "sl100", "split", "apipe", "parg", "dyn", "greedy"):
        with pytest.raises(ValueError, match="unknown part"):
            Variant.parse(f"pipe_fma@8x1024/w4/s3/pre/{part}")
    for spec in (BEST, HYBRID_BEST, "auto/w8/s3"):
        v = Variant.parse(spec)
        assert Variant.parse(str(v)) == v
    assert Variant.parse("auto/w8/s3") == Variant()


def test_kernel_skips_its_work_when_every_active_row_has_stopped():
    """kernel_args(skip=(stopped, active)): every program skips its queue when every active
    row of the bucket has stopped (ops/row_stop.py) - nothing is written, the counters stay
    reset - and runs the whole step as without the check when one active row has not."""
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd, s0, ref = _with_fused_reference(2)
    mk = MegakernelStep(fd, st, 2)
    skip = (st.stopped, st.active)
    st.stopped[:2] = torch.tensor([1, 0], dtype=torch.int32)
    mk.run_kernel(skip=skip)
    _close_rows(_snapshot(st, fd), ref, 2)
    assert int(mk.compiled.counters.abs().sum()) == 0
    _restore(st, fd, s0)
    st.stopped[:2] = 1
    mk.run_kernel(skip=skip)
    got = _snapshot(st, fd)
    for f in FIELDS:
        assert torch.equal(got[f], s0[f]), f
    assert int(mk.compiled.counters.abs().sum()) == 0
    st.active[1] = False                # the stopped row 0 is the only active one: skipped
    st.stopped[:2] = torch.tensor([1, 0], dtype=torch.int32)
    mk.run_kernel(skip=skip)
    assert torch.equal(_snapshot(st, fd)["hidden"], s0["hidden"])
    _restore(st, fd, s0)
    st.stopped.zero_()
    mk.run_kernel(skip=skip)
    _close_rows(_snapshot(st, fd), ref, 2)


def test_the_schedule_bench_places_the_best_build_at_real_shapes():
    """bench/schedule_megakernel.py (no GPU, no weights) follows compile_program's steps for
    the "on" build at Moondream 2's shapes on the H200's 132 SMs: two programs per SM all
    used, a layer's attention as 32 heads x 3 key-split groups spread one per program
    round, a finite makespan (it had rotted once unnoticed: session 30). In a process of its
    own: the bench imports bench/compile_megakernel.py, which drops TRITON_INTERPRET."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    from photon_core.megakernel.megakernel_backend import BEST

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "bench" / "schedule_megakernel.py"),
                        "--variants", BEST, "--b", "1", "--kv", "832", "--n-sm", "132"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"b=1 {BEST}: "))
    got = ast.literal_eval(line.split(": ", 1)[1])
    assert got["programs"] == 264 and got["attn"] == 24 * 32 * 3
    assert got["max_attn_per_program"] <= 24 and 0 < got["est_makespan_us"] < 2000
