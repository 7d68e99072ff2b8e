"""Megakernel instructions: what one SM does in one step of its queue, and the table layout
the persistent kernel (kernel.py) reads.

A *program op* (ProgramOp) is one node of the step program as the megakernel runs it: a
whole GEMV (with the LayerNorm of its input fused in where the program has one before it),
attention over all (row, head) pairs (with the merge of the key splits), the row advance,
the greedy pick. The compiler (compiler.py) splits each op into *instructions* (Instr): a
row tile of a GEMV, a range of key splits of one (row, head) of attention, one row of the
advance / argmax. An instruction waits on at most two op counters (each until the producer
op's instruction count), and adds 1 to its own op's counter when it is done.

Operands are (buffer name, element offset) pairs (Operand); the compiler turns each into an
element offset relative to the base tensor of its dtype class (ARENAS), so the kernel needs
one pointer per dtype class instead of one per weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# op codes (the kernel's switch)
OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM, OP_ATTN, OP_ADVANCE, OP_ARGMAX = range(6)
# the hybrid families' ops (hybrid_lowering.py, hybrid_kernel.py): a GEMV with its K, norm
# and epilogue in the table, a Gated DeltaNet (row, key head), gated attention (row, head,
# key split) and its merge (row, head)
OP_HGEMV, OP_DELTA, OP_GATTN, OP_GMERGE = 6, 7, 8, 9
# Gemma 4's: window attention (row, head, key split) and its merge (row, head), the sandwich
# norm + residual add (+ layer scalar) per row
OP_WATTN, OP_WMERGE, OP_NORMADD = 10, 11, 12
OP_NAMES = {OP_GEMV_W1: "gemv_w1", OP_GEMV_W2: "gemv_w2", OP_GEMV_LM: "gemv_lm",
            OP_ATTN: "attention", OP_ADVANCE: "advance", OP_ARGMAX: "argmax",
            OP_HGEMV: "gemv", OP_DELTA: "delta_net", OP_GATTN: "gated_attention",
            OP_GMERGE: "gated_attention_merge", OP_WATTN: "window_attention",
            OP_WMERGE: "window_attention_merge", OP_NORMADD: "norm_add"}

# dtype classes of the operands: one base pointer each in the kernel
ARENAS = ("w", "f", "i", "u")      # model dtype, fp32, int64, uint8 (bools)

# the int64 instruction table: one row of N_FIELDS per instruction
(F_OP, F_A, F_W, F_B, F_Y, F_N0, F_N1, F_P0, F_P1, F_P2, F_P3,
 F_WAIT0, F_TGT0, F_WAIT1, F_TGT1, F_SIG, F_P4, F_P5, F_P6, F_P7) = range(20)
N_FIELDS = 20
NO_WAIT = -1


@dataclass(frozen=True)
class Operand:
    """buffer name (a key of the lowering's buffer dict) and an element offset into it."""
    buf: str
    offset: int = 0


@dataclass
class ProgramOp:
    """One op of the step program. kind: one of OP_NAMES' values; args: Operand per role
    (op-specific, see lowering_moondream.py); params: ints (n_split, gap, rows...);
    after: names of the ops whose outputs it reads (or whose inputs it overwrites)."""
    name: str
    kind: int
    args: dict[str, Operand]
    params: dict[str, int] = field(default_factory=dict)
    after: tuple[str, ...] = ()
    rows: tuple[int, int] = (0, 0)      # GEMV: the weight rows [n0, n1) this op covers


@dataclass
class Instr:
    """One scheduled unit of work. tile: GEMV rows [n0, n1); advance / argmax: (row, row + 1);
    attention: (row, head), sub: its key splits [s0, s1) (flash-decoding chunks of the fused
    kernel), of `n_sub` instructions of that (row, head). waits: (counter, target) pairs; signal: the
    counter it adds 1 to (its op's index). cost: estimated microseconds (compiler.py)."""
    op: int
    op_name: str
    tile: tuple[int, int]
    args: dict[str, Operand]
    params: dict[str, int]
    waits: tuple[tuple[int, int], ...]
    signal: int
    cost: float
    sub: tuple[int, int] = (0, 0)
    n_sub: int = 1
    index: int = -1          # position in the topological order
    sm: int = -1             # assigned by the scheduler
    start: float = 0.0       # the scheduler's estimated start / end (us)
    end: float = 0.0
    ln_reuse: bool = False   # GEMV with a fused LayerNorm: its program's scratch already
    #                          holds it (the previous instruction of the queue computed it)
    fill: bool = False       # one block of a fill op: the scheduler deals these out and
    #                          merges them per program (compiler._fill)
    polled: tuple[tuple[int, int], ...] | None = None   # the waits the kernel polls (the
    #                          table's): compiler.elide_waits drops those its program already
    #                          made; None: all of waits

    @property
    def inputs(self) -> tuple[Operand, ...]:
        return tuple(v for k, v in self.args.items() if not k.startswith("out"))

    @property
    def outputs(self) -> tuple[Operand, ...]:
        return tuple(v for k, v in self.args.items() if k.startswith("out"))
