"""The megakernel as the runtime's step backend (EngineOptions.megakernel): the fused backend
(fast/fused_backend.py) with its forward piece - feedback, decoder, row advance - replaced by
the feedback launch plus ONE megakernel launch per step (megakernel_step.py, head=False).
Everything else (the sample pieces' heads, the prompt prefill, the encoders) is the fused
backend's, so the pipelined runtime above it (CUDA graphs per bucket, ping-pong slots,
forward-now-sample-later, zombies) drives it unchanged.

    backend = megakernel_backend(fused, st, "pipe_fma@8x1024/w4/s3/p2/a3/fill/pre")
    -> (MegakernelBackend, "") or (None, the reason it cannot serve: the caller keeps fused)

The lm pick stays a sample piece (the megakernel's own lm / argmax tail would write the
NEXT step's pick into `out` before the pipeline stages this step's values).
SKIP_STOPPED (off until measured): before the megakernel, ops/row_stop.py marks the rows whose
pick was their task's stop token, and the megakernel's programs skip their queues when every
active row has stopped (kernel_args(skip=...)).
"""
from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import tempfile

import torch

from ..ops.row_stop import row_stop
from .kernel import interpreted
from .hybrid_lowering import is_hybrid
from .lowering import Unsupported
from .megakernel_step import MegakernelStep, Variant

log = logging.getLogger(__name__)


def auto_spec(fd) -> str:
    """EngineOptions.megakernel "auto" (the default) -> "on" where the megakernel was measured
    to win (a Hopper GPU, sm_90: the H200, docs/benchmarks.md) under the fused backend `fd`,
    else "off" (other GPUs: not measured; the CPU and the interpreter: far slower than the
    fused kernels there)."""
    if fd is None or interpreted():
        return "off"
    if is_hybrid(fd):
        return "off"        # the hybrid lowering (Qwen 3.5, Gemma 4): slower (sessions 24-25)
    dev = torch.device(fd.x.device)
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
        return "off"
    return "on"


def resolve_variant(spec: str, hybrid: bool = False) -> Variant | None:
    """EngineOptions.megakernel -> the Variant to build (None: "off"). "on": the measured
    best b=1 build on the H200 (docs/benchmarks.md: Moondream 2's BEST, sessions 6-9; the
    hybrid lowering's HYBRID_BEST, session 25) on CUDA, Variant() under the interpreter (one
    program: no programs per SM to speak of there)."""
    if spec == "off":
        return None
    if spec == "on":
        return Variant() if interpreted() else Variant.parse(HYBRID_BEST if hybrid else BEST)
    return Variant.parse(spec)


# rows that picked a stop token (ops/row_stop.py) mark themselves before the megakernel, whose
# programs then skip their queues when every active row of the bucket has stopped: the step
# that sampled eos and the zombie step after it cost no decoder pass. Measured (session 25
# call 3): 0.8936 vs 0.8876 ms per active step (its check costs ~6 us; the bench has no stop
# steps to gain on) - off.
SKIP_STOPPED = False

# three key splits per attention instruction since session 9 (calls 19-20: 0.908-0.909 vs
# 0.929-0.934 ms for a2 in the same runs, with the fitted fill constants; a4 0.952); a
# program's repeated waits elided and the GEMV blocks' bias / residual loaded at their first
# step since session 27 (call 3: 0.8699-0.8733 ms vs 0.8890-0.8962 without, same process),
# its waits polled by one thread per program (call 6: 0.8668-0.8682 vs 0.8754-0.8795 ms; the
# hybrid kernel lost with it: Qwen 1.010-1.014 vs 0.962 ms). Not `parg` (removed in session
# 39; the greedy pick from the lm instructions' partial picks: the traced argmax 2.1 vs 19.2
# us, but the step the same within +-3 us over three calls of session 28: 0.8612-0.8646 vs
# 0.8634-0.8658, 0.8716 / 0.8728 vs 0.8697 / 0.8658, 0.8648-0.8651 vs 0.8626-0.8674 ms). A
# head's key splits in instructions of 2 + 3 + 3, not 3 + 3 + 2, since session 29 (`tail`,
# compiler.split_groups: at the decode positions after Moondream 2's 730-position image
# prefix the trailing splits hold few keys or none; the same bits): position 760,
# 1024-position cache 0.8731-0.8777 vs 0.8781-0.8816 ms (call 7), position 785 0.8729-0.8737
# vs 0.8775-0.8798 (call 3); encode + detect(5) GPU busy 28.75 / 28.76 vs 28.85 / 28.88 ms
# (call 7). Not `dyn` (removed in session 39; the keyed splits shared out at run time):
# slower with the fitted fill schedule (0.8884-0.8896 vs 0.8826-0.8833 ms, call 5)
BEST = "pipe_fma@8x1024/w4/s3/p2/a3/fill/pre/elide/early/poll1/tail"
# In deterministic mode the fused step sums Moondream 2's decoder GEMVs in BEST's tiles at
# one row (ops/gemv.MEGAKERNEL_ORDER_TILES) and merges the attention's splits in split order, as
# this kernel does: BEST's passes are the fused deterministic step's bits (session 37)
# the hybrid kernel's (Qwen 3.5, Gemma 4) best b=1 build on the H200 (docs/benchmarks.md
# session 25: Qwen 3.5 0.8B 0.961 ms, Gemma 4 E2B 3.207 ms - still slower than the fused
# graph's 0.83 / 2.04 ms, so "auto" keeps them off; the variants it beat:
# docs/dropped_experiments.md); with elided waits and prefetched records since session 27
# (call 2: Qwen 0.9588 / 0.9601 ms vs 0.9627 / 0.9656)
HYBRID_BEST = "pipe_fma@8x1024/w8/s3/pre/red/elide/rpf"
# "on" runs the megakernel for buckets up to this batch (the measured win, session 8: b=1
# 0.936 vs 1.101 ms for the deterministic fused graph, 1.029 split-K; b=2 / 4 / 8 lose:
# 1.69 vs 1.28, 1.88 vs 1.38, 2.16 vs 1.56 ms), the fused forward above it
ON_MAX_BATCH = 1


_BUILDS = itertools.count()       # (one reproducer prefix per build of the process)


@contextlib.contextmanager
def reproducer_file(prefix: str | None = None):
    """Inside the block, Triton's compiler writes the MLIR reproducer of a failing pass
    pipeline (the whole module: ~200-300 KB, ~3000 lines for the hybrid kernel, session 23)
    to files `prefix.<stage>.repro.mlir` (TRITON_REPRODUCER_PATH) instead of stderr, so a
    failed build logs its ~30-line diagnostic, not pages of IR over the node's log. Yields
    the prefix; the files are removed when the block ends without an exception (the compiler
    writes one per stage it runs), kept for the log line otherwise. The variable is
    process-wide for the block's duration (another thread's compile writes there too; two
    builds at once: the later one's prefix until it ends)."""
    prefix = prefix or os.path.join(tempfile.gettempdir(),
                                    f"photon_megakernel_{os.getpid()}_{next(_BUILDS)}")
    old = os.environ.get("TRITON_REPRODUCER_PATH")
    os.environ["TRITON_REPRODUCER_PATH"] = prefix
    ok = False
    try:
        yield prefix
        ok = True
    finally:
        if old is None:
            os.environ.pop("TRITON_REPRODUCER_PATH", None)
        else:
            os.environ["TRITON_REPRODUCER_PATH"] = old
        if ok:
            for f in glob.glob(glob.escape(prefix) + ".*repro.mlir"):
                with contextlib.suppress(OSError):
                    os.remove(f)


def reproducers(prefix: str) -> str:
    """ " (the compiler's reproducer: <files>)" for what a failed build left, else ""."""
    files = sorted(glob.glob(glob.escape(prefix) + ".*repro.mlir"))
    return f" (the compiler's reproducer: {', '.join(files)})" if files else ""


class MegakernelBackend:
    """The fused backend `fd` with forward() through the megakernel; one compiled
    MegakernelStep per bucket, built on the bucket's first forward (the runner's warm-up,
    before any graph capture)."""

    def __init__(self, fd, st, variant: Variant, n_sm: int | None = None,
                 max_batch: int | None = None):
        """max_batch: buckets above it run the fused forward (None: every bucket tries the
        megakernel; a bucket whose shapes the variant cannot lower runs the fused forward,
        logged once)."""
        self.fd, self.st, self.variant, self.n_sm = fd, st, variant, n_sm
        self.max_batch = max_batch
        self.steps: dict[int, MegakernelStep] = {}
        self.launched: set[int] = set()             # buckets whose kernel has run (compiled)
        self.fused_buckets: dict[int, str] = {}     # bucket -> why it runs the fused forward

    def __getattr__(self, name):           # heads, prefill, buffers: the fused backend's
        return getattr(self.__dict__["fd"], name)

    def step_for(self, b: int) -> MegakernelStep:
        s = self.steps.get(b)
        if s is None:
            s = self.steps[b] = MegakernelStep(self.fd, self.st, b, n_sm=self.n_sm,
                                               variant=self.variant, head=False)
        return s

    def forward(self, st, b: int, attn_len: int) -> None:
        """fd.forward's feed + decoder + row advance: the feedback launch, then the
        megakernel (attention over the rows' positions: attn_len is for window families,
        which have no lowering)."""
        if b not in self.steps and b not in self.fused_buckets:
            if self.max_batch is not None and b > self.max_batch:
                self.fused_buckets[b] = f"bucket above {self.max_batch}"
            else:
                try:
                    self.step_for(b)
                except Unsupported as e:
                    self.fused_buckets[b] = f"no lowering at this bucket: {e}"
            if b in self.fused_buckets:
                log.info("megakernel: bucket %d runs the fused forward (%s)", b,
                         self.fused_buckets[b])
        if b in self.fused_buckets:
            self.fd.forward(st, b, attn_len)
            return
        s = self.steps[b]
        s.feed()
        if SKIP_STOPPED and not s.hybrid:
            st = self.st
            row_stop(st.out[:b], st.phase[:b], st.stop_ids[:b], st.stop_phases[:b],
                     st.stopped[:b])
            kw = {"skip": (st.stopped, st.active)}
        else:
            kw = {}
        if b in self.launched or interpreted():
            s.run_kernel(**kw)       # (the interpreter compiles nothing: an error is a bug)
            return
        # the bucket's first launch compiles its kernel: a build that fails here (bucket 1
        # was tried at construction; a larger bucket's shapes may not compile) leaves the
        # bucket on the fused forward instead of failing the step (the compile precedes the
        # launch: nothing was written but the feedback, which the fused forward redoes)
        try:
            with reproducer_file() as prefix:
                s.run_kernel(**kw)
        except Exception as e:      # noqa: BLE001
            self.fused_buckets[b] = (f"megakernel build failed: {type(e).__name__}: "
                                     f"{str(e)[:500]}{reproducers(prefix)}")
            del self.steps[b]
            log.warning("megakernel: bucket %d runs the fused forward (%s)", b,
                        self.fused_buckets[b])
            self.fd.forward(st, b, attn_len)
            return
        self.launched.add(b)


def megakernel_backend(fd, st, spec: str) -> tuple[MegakernelBackend | None, str]:
    """The megakernel backend over fused backend `fd` (None: the fused backend is off) for
    EngineOptions.megakernel `spec`, or (None, why not). Checks: a fused backend, a device
    the kernel runs on (CUDA, or the CPU under TRITON_INTERPRET=1), the program's lowering
    (bucket 1), and on CUDA one trial launch (cooperative grid) with every row inactive."""
    if spec == "off":
        return None, "megakernel off"
    if fd is None:
        return None, ("the megakernel runs over the fused backend's tensors and the fused "
                      "backend is off (EngineOptions.fused)")
    variant = resolve_variant(spec, is_hybrid(fd))
    dev = torch.device(fd.x.device)
    if dev.type != "cuda" and not interpreted():
        return None, f"no CUDA device ({dev}) and not TRITON_INTERPRET=1"
    max_b = ON_MAX_BATCH if spec == "on" else None
    be = MegakernelBackend(fd, st, variant, max_batch=max_b)
    stage, prefix = "build", None
    try:
        # (a compile failure propagates out of the block: its reproducer files are kept)
        with reproducer_file() as prefix:
            try:
                be.step_for(1)
            except Unsupported:
                if spec != "on" or variant == Variant():
                    raise
                # "on": the best build's GEMV tiles do not fit this model's widths (a small
                # model): the default build's tiles
                be = MegakernelBackend(fd, st, Variant(), max_batch=max_b)
                be.step_for(1)
            if dev.type == "cuda" and not interpreted():
                if bool(st.active.any()):
                    return None, ("rows in use at build time (the trial launch needs them "
                                  "inactive)")
                stage = "launch"   # all rows inactive: k/v writes land on not-yet-valid slots
                be.step_for(1).run_kernel()     # (compiles: a failure, or no cooperative
                torch.cuda.synchronize(dev)     # launch, keeps the fused backend)
                be.launched.add(1)
    except Unsupported as e:
        return None, f"no megakernel lowering for this model's step program: {e}"
    except Exception as e:       # noqa: BLE001 - a compile / shape / launch failure: fused
        return None, (f"megakernel {stage} failed: {type(e).__name__}: {str(e)[:500]}"
                      f"{reproducers(prefix) if prefix else ''}")
    return be, ""


def pick_backend(fd, st, spec: str):
    """StepState's choice: the megakernel backend, or `fd` (the fused backend, maybe None)
    with the reason logged. Returns (backend or None, fallback reason or "")."""
    be, why = megakernel_backend(fd, st, spec)
    if be is None:
        log.warning("megakernel %r not used, fused backend kept: %s", spec, why)
        return None, why
    log.info("megakernel backend: %s", be.variant)
    return be, ""
