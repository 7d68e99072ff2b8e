"""Step program -> instruction list -> static per-SM schedule -> the kernel's tensors.

1. split (split_ops): each ProgramOp becomes instructions. GEMVs are cut into row tiles of
   whole BLOCK_N blocks, about one tile per SM per op (so every SM has work in every GEMV);
   advance / argmax one instruction per row; attention one per (row, head, group of key
   splits), the groups sized so that one layer's attention fills the SMs about once (b=1:
   2 of 7 splits per instruction; b=8: all of them; the variants' aN sets it; tail: the
   larger groups last, split_groups), the last of a (row, head) to finish merging its
   splits (a per-(row, head) counter).
   Each instruction waits on the counters of the ops listed in its op's `after` (until each
   reaches that op's instruction count) and signals its own op's counter.
2. schedule: list scheduling in topological (program) order: each instruction goes to the SM
   where it can start first (max of the SM's free time and the end of its dependencies),
   by the cost model below. Every SM's queue is therefore in topological order, which with
   all programs resident (cooperative launch) cannot deadlock: the earliest unfinished
   instruction in that order always has its dependencies done and sits at the head of its
   queue.
3. tensors: the int64 instruction table (instructions.py layout) sorted by queue, the
   queue offsets [n_programs + 1] (int32) and the counters (int32): one per op (CNT_STRIDE
   apart), one per
   (row, head) of attention, and last the count of finished programs (the last program to
   finish zeroes all of them, so the next launch starts from 0). A GEMV with a fused
   LayerNorm gets its program's private scratch rows as its input (offset by program).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch

from .instructions import (ARENAS, F_A, F_B, F_N0, F_N1, F_OP, F_P0, F_P1, F_P2, F_P3,
                           F_SIG, F_TGT0, F_TGT1, F_W, F_WAIT0, F_WAIT1, F_Y, N_FIELDS,
                           NO_WAIT, OP_ADVANCE, OP_ARGMAX, OP_ATTN, OP_DELTA, OP_GATTN,
                           OP_GMERGE, OP_GEMV_LM, OP_GEMV_W1, OP_GEMV_W2, OP_HGEMV, OP_NORMADD,
                           OP_WATTN, OP_WMERGE, F_P4, F_P5, F_P6, F_P7, Instr, Operand,
                           ProgramOp)

GEMV_OPS = (OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM)
NORM_GEMV_OPS = GEMV_OPS + (OP_HGEMV,)     # GEMVs that may compute their input's norm
# cost model (us): bytes at one SM's share of the copy bandwidth + a fixed cost per
# instruction (wait, fetch, signal); H200: 4.26 TB/s over 132 SMs
SM_BYTES_PER_US = 4.26e6 / 132
INSTR_US = 0.6
# fill schedules (compile_program fill=True, the "on" build) model an attention
# instruction's latency too and a program's share of its SM's bandwidth (per_sm), with
# constants fitted to a trace of that build on the H200 (bench/trace_megakernel.py
# --calibrate, session 8: GEMV work = bytes / rate + fixed by least squares over 18,880
# instructions, attention's latency its median work minus its bytes; a sweep around them
# kept these): the step's schedule 0.961 -> 0.937 ms, the same bits. The per-byte rate is
# the marginal cost of a byte with the SM's other program streaming beside it, not a share
# of the copy bandwidth; the fixed cost holds the wait, the signal and the ramp-up.
FILL_SM_BYTES_PER_US = 73210.0
FILL_INSTR_US = 2.19
ATTN_LATENCY_US = 1.79      # (3.0 before the fit: 0.961 ms; 1.0: 0.955, 3.0 with the rest: 0.945)
# op counters lie CNT_STRIDE int32 apart (128 bytes: one L2 line each), so the spinning
# reads of one op's counter do not share a line with the atomic adds on another's; the
# table's wait / signal fields hold the scaled index, the per-(layer, row, head) merge
# counters follow at len(ops) * CNT_STRIDE
CNT_STRIDE = 32


def arena_of(t: torch.Tensor, model_dtype: torch.dtype) -> str:
    if t.dtype == torch.float32 and model_dtype != torch.float32:
        return "f"
    if t.dtype == model_dtype:
        return "w"
    return {torch.float32: "f", torch.int64: "i", torch.uint8: "u"}[t.dtype]


@dataclass
class Compiled:
    instrs: list[Instr]              # in queue order (SM 0's queue first)
    ops: list[ProgramOp]
    table: torch.Tensor              # int64 [n_instr, N_FIELDS]
    queue: torch.Tensor              # int32 [n_programs + 1]
    counters: torch.Tensor           # int32 [n_ops * CNT_STRIDE + n_layers * b * n_heads + 1]
    n_programs: int
    bases: dict[str, torch.Tensor]   # arena -> base tensor
    offsets: dict[str, int]          # buffer name -> element offset in its arena
    makespan_us: float               # the scheduler's estimate
    aligned: bool                    # every offset the kernel hints a multiple of 16 elements

    def queues(self) -> list[list[Instr]]:
        q = self.queue.tolist()
        return [self.instrs[q[p]:q[p + 1]] for p in range(self.n_programs)]


def attn_splits_per_instr(b: int, shape: dict, n_sm: int) -> int:
    """Key splits per attention instruction: the fewest instructions that still give every
    SM one (b * heads * splits / n_sm, at least 1, at most all of a head's splits)."""
    total = b * shape["NH"] * shape["NSPLIT"]
    return max(1, min(shape["NSPLIT"], math.ceil(total / n_sm)))


def blocks_per_tile(blocks: int, n_sm: int) -> int:
    """A GEMV op's row blocks per instruction: about one instruction per SM (split_ops)."""
    return max(1, math.ceil(blocks / n_sm))


def split_groups(ns: int, per: int, tail: bool = False) -> list[tuple[int, int]]:
    """A (row, head)'s key splits [0, ns) as the [s0, s1) groups of its attention
    instructions, ceil(ns / per) of them: `per` splits each from the first, the last group
    the remainder (3 + 3 + 1 for 7 splits at per 3); tail: the same count of groups, their
    sizes as equal as they go with the larger ones last (2 + 2 + 3). A decode position
    fills the splits from the first: the trailing ones hold the fewest keys (none past the
    position), so the tail form's longest group is mostly masked loads and the full splits
    are shared out - each split's partials and the merge over all splits are the same
    either way (the same bits)."""
    n = math.ceil(ns / per)
    if not tail:
        return [(s0, min(ns, s0 + per)) for s0 in range(0, ns, per)]
    base, extra = divmod(ns, n)
    ends = list(itertools.accumulate([base] * (n - extra) + [base + 1] * extra))
    return list(zip([0] + ends[:-1], ends))


def split_ops(ops: list[ProgramOp], b: int, shape: dict, gemv_cfg: dict, n_sm: int,
              elsize: int, attn_per: int | None = None, fill: bool = False,
              per_sm: int = 1, tail: bool = False) -> list[Instr]:
    """fill: GEMV ops with params["fill"] are cut into single BLOCK_N blocks, which
    schedule() then deals out by the programs' free times (and merges per program);
    attention instructions cost their latency too (ATTN_LATENCY_US), and every cost uses
    the fill constants (FILL_SM_BYTES_PER_US per SM, shared by its per_sm programs;
    FILL_INSTR_US). tail: attention's key-split groups with the larger ones last
    (split_groups)."""
    bw = FILL_SM_BYTES_PER_US if fill else SM_BYTES_PER_US
    fixed = FILL_INSTR_US if fill else INSTR_US
    rate = bw / (per_sm if fill else 1)
    names = {op.name: k for k, op in enumerate(ops)}
    counts: list[int] = []
    out: list[Instr] = []
    for k, op in enumerate(ops):
        waits = []
        for a in op.after:
            j = names[a]
            assert j < k, f"{op.name} comes before {a}: the program must be in order"
            waits.append((j, counts[j]))
        assert len(waits) <= 2, f"{op.name}: at most 2 dependencies per instruction"
        tiles, costs, subs, n_sub = [], [], [], 1
        dealt = bool(fill and op.kind in GEMV_OPS and op.params.get("fill"))
        if op.kind in NORM_GEMV_OPS:
            cfg = gemv_cfg[op.kind]
            kdim = op.params["k"] if op.kind == OP_HGEMV else \
                shape["KW2"] if op.kind == OP_GEMV_W2 else shape["D"]
            n0, n1 = op.rows
            assert n0 % cfg.block_n == 0, (op.name, n0, cfg.block_n)
            blocks = math.ceil((n1 - n0) / cfg.block_n)
            per = 1 if dealt else blocks_per_tile(blocks, n_sm)
            for t0 in range(0, blocks, per):
                r0 = n0 + t0 * cfg.block_n
                r1 = min(n1, n0 + (t0 + per) * cfg.block_n)
                tiles.append((r0, r1))
                ln = b * shape["D"] * 4 / rate if "ln_inp" in op.args else 0.0
                costs.append((r1 - r0) * kdim * elsize / rate + fixed + ln)
        elif op.kind == OP_ATTN:
            per = attn_per or attn_splits_per_instr(b, shape, n_sm)
            ns = shape["NSPLIT"]
            groups = split_groups(ns, per, tail)
            n_sub = len(groups)
            kv = 2 * shape["CHUNK"] * shape["HD"] * elsize    # one split (a full cache)
            merge = ns * (shape["HD"] + 2) * 4 / bw
            for r in range(b):
                for h in range(shape["NH"]):
                    for s0, s1 in groups:
                        tiles.append((r, h))
                        subs.append((s0, s1))
                        costs.append((s1 - s0) * kv / rate + fixed + merge
                                     + (ATTN_LATENCY_US if fill else 0.0))
        elif op.kind in (OP_WATTN, OP_WMERGE):
            # window attention: (row, head, key split) over its share of the layer's slots;
            # the merge per (row, head)
            n_sub = shape["NSPLIT"] if op.kind == OP_WATTN else 1
            hd = op.params["hd"]
            nbytes = (2 * op.params["slots"] * hd * elsize / n_sub if op.kind == OP_WATTN
                      else n_sub * (hd + 2) * 4)
            for r in range(b):
                for h in range(shape["NH"]):
                    for sp in range(n_sub):
                        tiles.append((r, h))
                        subs.append((sp, sp + 1))
                        costs.append(nbytes / rate + fixed)
        elif op.kind in (OP_DELTA, OP_GATTN, OP_GMERGE):
            # (row, key head): its value heads' fp32 states read and written; (row, head, key
            # split): its share of the cache's k / v (over the capacity: the position is not
            # known here); the merge (row, head): the splits' partials
            heads = shape["HK"] if op.kind == OP_DELTA else shape["NH"]
            n_sub = shape["NSPLIT"] if op.kind == OP_GATTN else 1
            nbytes = {OP_DELTA: 2 * shape["HV"] // shape["HK"] * shape["DK"] * shape["DV"] * 4,
                      OP_GATTN: 2 * shape["CAP"] * shape["HD"] * elsize / n_sub,
                      OP_GMERGE: n_sub * (shape["HD"] + 2) * 4}[op.kind]
            for r in range(b):
                for h in range(heads):
                    for sp in range(n_sub):
                        tiles.append((r, h))
                        subs.append((sp, sp + 1))
                        costs.append(nbytes / rate + fixed)
        else:
            width = shape["V"] if op.kind == OP_ARGMAX else shape["D"]
            for r in range(b):
                tiles.append((r, r + 1))
                costs.append(width * 4 / rate + fixed)
        subs = subs or [(0, 0)] * len(tiles)
        for t, c, sb in zip(tiles, costs, subs):
            out.append(Instr(op.kind, op.name, t, op.args, op.params, tuple(waits), k, c,
                             sub=sb, n_sub=n_sub, index=len(out), fill=dealt))
        counts.append(len(tiles))
    return out


def schedule(instrs: list[Instr], n_sm: int) -> float:
    """Greedy list scheduling in topological order; sets sm/start/end; returns the makespan.
    An instruction goes to the SM holding the fewest instructions of its own op first, then
    the earliest free (session 4, H200: the plain earliest-free rule stacked up to 5 of a
    layer's 128 attention instructions on one SM, b=1: they looked cheap next to the GEMV
    tiles, but each costs ~7 us of latency, so one program carried 120 of the 3072 attention
    instructions and attention alone took 0.8 ms per step; a GEMV op's tiles are at most
    n_sm anyway; that rule, the variants' "greedy", was measured slower again in session 5
    and removed in session 39)."""
    free = [0.0] * n_sm
    op_end: dict[int, float] = {}
    out: list[Instr] = []
    k = 0
    while k < len(instrs):
        sig = instrs[k].signal            # an op's instructions are consecutive, same waits
        j = k
        while j < len(instrs) and instrs[j].signal == sig:
            j += 1
        group, k = instrs[k:j], j
        if group[0].fill:
            out += _fill(group, free, op_end)
            continue
        out += group
        ready = max((op_end[c] for c, _ in group[0].waits), default=0.0)
        # rounds: every SM gets one of the op's instructions before any gets a second;
        # within a round the SMs in (start time, index) order - placing on one changes no
        # other's key, so that order is the sequence of argmins
        for r0 in range(0, len(group), n_sm):
            part = group[r0:r0 + n_sm]
            ranked = sorted(range(n_sm), key=lambda s: (max(free[s], ready), s))
            for ins, sm in zip(part, ranked):
                _place(ins, sm, free, ready, op_end)
    if len(out) != len(instrs):          # fill ops merged: the waits count their tiles anew
        n_of: dict[int, int] = {}
        for i in out:
            n_of[i.signal] = n_of.get(i.signal, 0) + 1
        for j, i in enumerate(out):
            i.waits = tuple((c, n_of[c]) for c, _ in i.waits)
            i.index = j
        instrs[:] = out
    return max(free)


def _place(ins: Instr, sm: int, free: list[float], ready: float,
           op_end: dict[int, float]) -> None:
    ins.sm, ins.start = sm, max(free[sm], ready)
    ins.end = ins.start + ins.cost
    free[sm] = ins.end
    op_end[ins.signal] = max(op_end.get(ins.signal, 0.0), ins.end)


def _fill(group: list[Instr], free: list[float], op_end: dict[int, float]) -> list[Instr]:
    """A fill op's single-block instructions (consecutive rows, equal cost but maybe the
    last) dealt out one at a time to the program that would finish it first (so programs
    busy longer - e.g. with an attention instruction - get fewer rows), then each
    program's blocks merged into one instruction of consecutive rows (programs in order)."""
    first = group[0]
    ready = max((op_end[c] for c, _ in first.waits), default=0.0)
    fixed = FILL_INSTR_US            # (fill groups exist only in fill schedules)
    per_block = [i.cost - fixed for i in group]
    n = [0] * len(free)
    start = [max(f, ready) for f in free]
    heap = [(start[p] + fixed + per_block[0], p) for p in range(len(free))]
    heapq.heapify(heap)
    for j in range(len(group)):
        t, p = heapq.heappop(heap)
        n[p] += 1
        if j + 1 < len(group):
            heapq.heappush(heap, (t + per_block[j + 1], p))
    merged, j = [], 0
    for p, cnt in enumerate(n):
        if not cnt:
            continue
        part = group[j:j + cnt]
        j += cnt
        ins = part[0]
        ins.tile = (part[0].tile[0], part[-1].tile[1])
        ins.cost = fixed + sum(i.cost - fixed for i in part)
        ins.sm, ins.start = p, start[p]
        ins.end = ins.start + ins.cost
        free[p] = ins.end
        op_end[ins.signal] = max(op_end.get(ins.signal, 0.0), ins.end)
        merged.append(ins)
    return merged


def fill_order(ops: list[ProgramOp]) -> list[ProgramOp]:
    """ops with every fill-marked op moved just after the attention op that follows it
    (none of the ops moved past reads its output: the lowering's order of the rest is
    kept)."""
    out = list(ops)
    for op in ops:
        if not op.params.get("fill"):
            continue
        k = out.index(op)
        j = next((i for i in range(k + 1, len(out)) if out[i].kind == OP_ATTN), None)
        # (the ops it would move past, the attention included, must not read its output; it
        # cannot read theirs: they come after it in program order)
        if j is None or any(op.name in o.after for o in out[k + 1:j + 1]):
            continue
        out.insert(j, out.pop(k))
    return out


def ln_key(ins: Instr):
    """What a GEMV's fused LayerNorm computes: its operands and the counter states it waits
    for (None: no LayerNorm)."""
    a = ins.args
    if ins.op not in NORM_GEMV_OPS or "ln_inp" not in a:
        return None
    return a["ln_inp"], a["ln_gamma"], a.get("ln_beta"), ins.waits


def mark_ln_reuse(queues: list[list[Instr]]) -> None:
    """A GEMV whose fused LayerNorm is the one the previous instruction of its queue just
    computed into the program's scratch (same operands, same waits: e.g. w1fc1.i after
    w1qkv.i) reads the scratch instead of computing it again (one LayerNorm, its x reads and
    its CTA barrier less per layer and program). Same waits = the same version of the
    input: anything writing it in between would race with the first instruction's read."""
    for q in queues:
        last = None
        for ins in q:
            key = ln_key(ins)
            ins.ln_reuse = key is not None and key == last
            if ins.op not in (OP_ATTN, OP_DELTA, OP_GATTN, OP_GMERGE):  # (these write
                #                                                neither x nor the scratch rows)
                last = key


def elide_waits(queues: list[list[Instr]]) -> None:
    """Each instruction polls only the waits its program has not made yet (Instr.polled):
    counters only grow during a launch, and a program's earlier acquire of counter c at >= t
    orders everything after it in its queue, so a later wait for c at <= t is met and
    ordered already (e.g. a GEMV reusing its program's LayerNorm waits as the one that
    computed it: one acquire round trip less)."""
    for q in queues:
        seen: dict[int, int] = {}
        for ins in q:
            ins.polled = tuple((c, t) for c, t in ins.waits if seen.get(c, -1) < t)
            for c, t in ins.waits:
                seen[c] = max(seen.get(c, 0), t)


def compile_program(ops: list[ProgramOp], buffers: dict[str, torch.Tensor], b: int,
                    shape: dict, gemv_cfg: dict, n_sm: int,
                    model_dtype: torch.dtype, attn_per: int | None = None,
                    fill: bool = False, per_sm: int = 1, elide: bool = False,
                    tail: bool = False) -> Compiled:
    """fill: each GEMV op marked params["fill"] (the lowering marks the GEMV that runs
    beside attention: Moondream's fc1 rows) moves after the attention op that follows it
    and its rows are dealt out by the programs' free times (schedule / _fill): the
    programs that hold attention get fewer of them, instead of every program running its
    equal tile first and attention after it on the critical path. tail: attention's key-split
    groups with the larger ones last (split_groups)."""
    elsize = torch.tensor([], dtype=model_dtype).element_size()
    if fill:
        ops = fill_order(ops)
    instrs = split_ops(ops, b, shape, gemv_cfg, n_sm, elsize, attn_per, fill, per_sm, tail)
    makespan = schedule(instrs, n_sm)
    # compact the SMs that got work into programs 0..P-1; queue order = topological order
    used = sorted({i.sm for i in instrs})
    prog = {s: p for p, s in enumerate(used)}
    queues: list[list[Instr]] = [[] for _ in used]
    for ins in instrs:                       # instrs is in topological order
        ins.sm = prog[ins.sm]
        queues[ins.sm].append(ins)
    mark_ln_reuse(queues)
    if elide:
        elide_waits(queues)
    ordered = [i for q in queues for i in q]
    queue = [0]
    for q in queues:
        queue.append(queue[-1] + len(q))
    # arenas: one base tensor per dtype class, every buffer an element offset from it
    dev = next(iter(buffers.values())).device
    bases: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    for name, t in buffers.items():
        a = arena_of(t, model_dtype)
        base = bases.setdefault(a, t)
        diff = t.data_ptr() - base.data_ptr()
        assert diff % t.element_size() == 0, name
        offsets[name] = diff // t.element_size()
    if model_dtype == torch.float32:         # fp32 model: the "f" operands live in "w"
        bases["f"] = bases["w"]
    for a in ARENAS:                         # an unused arena still needs a pointer
        bases.setdefault(a, torch.zeros(16, device=dev, dtype={
            "w": model_dtype, "f": torch.float32, "i": torch.int64, "u": torch.uint8}[a]))

    def off(o: Operand) -> int:
        v = offsets[o.buf] + o.offset
        return v

    d = shape["D"]
    rows = []
    for ins in ordered:
        r = [0] * N_FIELDS
        r[F_OP] = ins.op
        r[F_N0], r[F_N1] = ins.tile
        a = ins.args
        if ins.op in GEMV_OPS:
            r[F_A], r[F_W], r[F_B], r[F_Y] = (off(a["inp"]), off(a["w"]), off(a["bias"]),
                                              off(a["out"]))
            r[F_P0] = ins.params.get("n_split", 0)
            r[F_P1] = ins.params.get("gap", 0)
            r[F_P7] = -1            # no LayerNorm (operand offsets may be negative)
            if "ln_inp" in a:       # LayerNorm fused: into this program's rows of hs
                assert a["inp"].buf == "hs"
                r[F_A] = off(a["inp"]) + ins.sm * b * d
                r[F_P4], r[F_P5], r[F_P6] = (off(a["ln_inp"]), off(a["ln_gamma"]),
                                             off(a["ln_beta"]))
                r[F_P7] = -1 if ins.ln_reuse else ins.params["ln_in_f32"]
        elif ins.op == OP_ATTN:
            r[F_A], r[F_W], r[F_B], r[F_Y] = (off(a["qkv"]), off(a["kc"]), off(a["vc"]),
                                              off(a["out"]))
            r[F_P0] = off(a["pos"])
            r[F_P1], r[F_P2] = ins.sub
            r[F_P3] = ins.n_sub
            r[F_P4] = ins.params["layer"]       # its (layer, row, head) merge counter
        elif ins.op == OP_HGEMV:
            r[F_A], r[F_W], r[F_Y] = off(a["inp"]), off(a["w"]), off(a["out"])
            r[F_P0], r[F_P1] = ins.params["epi"], ins.params["k"]
            r[F_P2], r[F_P3] = ins.params["sx"], ins.params["sy"]
            # P7: -1 the input is a buffer's columns (or the scratch already holding the
            # norm), 1 the norm first (P4 its input, P5 its weight, P6 its kind), 2 the input
            # is the fp32 x; P4 / P5 of an act * mul epilogue: the multiplier, its row stride
            r[F_P7] = 2 if ins.params.get("fp32_in") else -1
            if "mul" in a:
                r[F_P4], r[F_P5] = off(a["mul"]), ins.params["s_mul"]
            if "ln_inp" in a:       # the norm first: into this program's rows of hs
                assert a["inp"].buf == "hs"
                r[F_A] = off(a["inp"]) + ins.sm * b * d
                r[F_P4], r[F_P5] = off(a["ln_inp"]), off(a["ln_gamma"])
                r[F_P6] = ins.params["ln_in_f32"]
                r[F_P7] = -1 if ins.ln_reuse else 1
        elif ins.op == OP_DELTA:
            r[F_A], r[F_W], r[F_B], r[F_Y] = (off(a["qkv"]), off(a["conv_w"]),
                                              off(a["conv_state"]), off(a["out"]))
            r[F_P0], r[F_P1], r[F_P2], r[F_P3] = (off(a["z"]), off(a["b_in"]), off(a["a_in"]),
                                                  off(a["state"]))
            r[F_P4], r[F_P5], r[F_P6] = off(a["a_log"]), off(a["dt_bias"]), off(a["norm_w"])
        elif ins.op == OP_GATTN:
            r[F_A], r[F_W], r[F_B], r[F_Y] = (off(a["qg"]), off(a["kc"]), off(a["vc"]),
                                              off(a["out"]))
            r[F_P0], r[F_P1], r[F_P2], r[F_P3] = (off(a["k"]), off(a["v"]), off(a["q_norm"]),
                                                  off(a["k_norm"]))
            r[F_P4], r[F_P5] = off(a["pos"]), off(a["pos_offset"])
            # the instruction's own q / k scratch ([2, head_dim]: no other instruction's)
            row, h = ins.tile
            sp = ins.sub[0]
            r[F_P6] = off(a["scratch"]) + ((row * shape["NH"] + h) * shape["NSPLIT"] + sp) \
                * 2 * shape["HD"]
            r[F_P7] = sp
        elif ins.op == OP_GMERGE:
            r[F_A], r[F_Y] = off(a["qg"]), off(a["out"])
        elif ins.op == OP_WATTN:
            pr = ins.params
            r[F_A], r[F_W], r[F_B], r[F_Y] = (off(a["q"]), off(a["kc"]), off(a["vc"]),
                                              off(a["out"]))
            r[F_P0], r[F_P1], r[F_P2], r[F_P3] = (off(a["k"]), off(a["v"]), off(a["q_norm"]),
                                                  off(a["k_norm"]))
            r[F_P4], r[F_P5] = off(a["cos"]), off(a["sin"])
            row, h = ins.tile
            sp = ins.sub[0]
            r[F_P6] = off(a["scratch"]) + ((row * shape["NH"] + h) * shape["NSPLIT"] + sp) \
                * 3 * shape["HDM"]
            flags = int(pr["writes"]) + 2 * int(pr["ring"]) + 4 * int(pr["full"])
            r[F_P7] = sp + 256 * flags + 65536 * pr["slots"]
        elif ins.op == OP_WMERGE:
            r[F_Y] = off(a["out"])
            r[F_P7] = int(ins.params["full"])
        elif ins.op == OP_NORMADD:
            r[F_A], r[F_W], r[F_Y] = off(a["src"]), off(a["w"]), off(a["x"])
            r[F_P0] = ins.params["s_src"]
            r[F_B] = off(a["scale"]) if "scale" in a else 0
            r[F_P1] = int("scale" in a)
        elif ins.op == OP_ADVANCE:
            r[F_A], r[F_Y] = off(a["x"]), off(a["out_hidden"])
            r[F_W], r[F_B] = off(a["active"]), off(a["out_first"])
            r[F_P0], r[F_P1], r[F_P2], r[F_P3] = (off(a["out_pos"]), off(a["out_phase"]),
                                                  off(a["kind"]), off(a["table"]))
        elif ins.op == OP_ARGMAX:
            r[F_A], r[F_Y] = off(a["logits"]), off(a["out"])
            r[F_P0], r[F_P1], r[F_P2] = (off(a["phase"]), off(a["first"]),
                                         ins.params["mask_col"])
        else:
            raise ValueError(ins.op)
        (r[F_WAIT0], r[F_TGT0]), (r[F_WAIT1], r[F_TGT1]) = (
            [(w * CNT_STRIDE, t) for w, t in (ins.waits if ins.polled is None else
                                              ins.polled)] + [(NO_WAIT, 0)] * 2)[:2]
        r[F_SIG] = ins.signal * CNT_STRIDE
        rows.append(r)
    # the kernel hints the a / w / b / y offsets of GEMV and attention instructions (and a
    # GEMV's LayerNorm operands) as multiples of 16 elements (16-byte vector loads): only
    # where all are
    hinted = [r[f] for r in rows if r[F_OP] in GEMV_OPS + (OP_ATTN,)
              for f in (F_A, F_W, F_B, F_Y)] + [
        r[f] for r in rows if r[F_OP] in GEMV_OPS for f in (F_P4, F_P5, F_P6)]
    aligned = all(v % 16 == 0 for v in hinted)
    table = torch.tensor(rows, dtype=torch.int64, device=dev)
    n_attn = sum(1 for op in ops if op.kind == OP_ATTN)
    assert sorted(op.params["layer"] for op in ops if op.kind == OP_ATTN) == list(range(n_attn))
    return Compiled(ordered, ops, table,
                    torch.tensor(queue, dtype=torch.int32, device=dev),
                    torch.zeros(len(ops) * CNT_STRIDE + n_attn * b * shape["NH"] + 1,
                                dtype=torch.int32, device=dev),
                    len(queues), bases, offsets, makespan, aligned)
