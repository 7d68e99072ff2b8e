"""The batched decode step of the runtime, as graph-capturable pieces over GPU-resident state.

Every row (batch slot) keeps on the device: its last hidden state, its next position (and
the rotary offset of its positions: PrefixState.position_offset), its phase and row kind (the
family's skill protocol: Moondream 2's text / x / y / size and detect vs point; a text family
has one phase), whether its next text pick is its first (no answer-marker mask), its
sampling settings, and whether it takes part in the current step (`active`). One step is

    sample:  values from the current hidden state with the heads its phase needs
             (the family's step program names them: Moondream's "lm", "coord", "size")
    forward: the step program through the backend: feedback (the value just sampled ->
             the next input embedding, ON THE GPU), the decoder at the row's position over the
             state cache, then the row advance (hidden, position, phase by the phase table)
             for the active rows.

The sampled values land in `out` [rows, 4] int64, which the pipelined decoder stages to the
host. The host never feeds a value back.

Backends (EngineOptions.fused): eager_backend.py (the ops' torch references; equal to the
reference path bit for bit in fp32) or fused_backend.py (the Triton kernels: "auto" = on CUDA
for bf16/fp16 models when triton imports); EngineOptions.megakernel ("auto": on a Hopper GPU): the fused
backend with its forward as one megakernel launch (megakernel/megakernel_backend.py), or the
fused backend with the reason logged where the megakernel cannot serve the model.
"""
from __future__ import annotations

import torch

from .. import weight_layout
from ..ops import HAVE_TRITON, triton_on
from ..ops.row_setup import row_setup, row_setup_reference
from ..ops.row_stop import MAX_STOP_IDS
from .eager_backend import EagerBackend
from .static_kv_cache import StaticKVCache

# a row's set-up for a new task as one Triton launch on CUDA (ops/row_setup.py) instead of
# ~13 small torch kernels; read at each set_row
ROW_SETUP_KERNEL = True


def first_state_on(w) -> bool:
    """No StepState has been built on the weights `w` yet, nor a graph captured with them
    (weight_layout.held)."""
    return not weight_layout.held(w)


def program_tensors(program, w: dict) -> list:
    """The tensors of w that the step program names (an op's weight prefix: its ".weight" /
    ".bias"; a feedback table; a parameter tensor): what its graphs read by address. Not
    the rest of the model (e.g. a vision tower, which the image encode reads)."""
    names: set[str] = set()

    def walk(obj):
        if isinstance(obj, str):
            names.add(obj)
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                walk(o)
        elif isinstance(obj, dict):
            walk(list(obj.keys()))
            walk(list(obj.values()))
        elif hasattr(obj, "__dataclass_fields__"):
            for f in obj.__dataclass_fields__:
                walk(getattr(obj, f))
    walk(program)
    return [t for k, t in w.items()
            if k in names or k.rsplit(".", 1)[0] in names]


class StepState:
    """Preallocated device state for `rows` batch slots (written only by start() and steps).
    family: the model family's runtime view (fast_family.py; a model providing
    fast_family() is taken too)."""

    def __init__(self, family, rows: int, kv: StaticKVCache, options=None):
        from ..engine import EngineOptions
        if hasattr(family, "fast_family"):
            family = family.fast_family()
        options = options or EngineOptions()
        spec = family.spec
        w = family.weights
        dev, dt = family.device, family.dtype
        self.family = family
        # the first StepState on these weights: no CUDA graph can read them yet, so its fused
        # backend may replace the weights it joins by views (FusedBackend share_weights)
        first_on_weights = first_state_on(w)
        self.options, self.spec, self.program = options, spec, spec.program
        self.rows, self.kv, self.w = rows, kv, w
        self.hidden = torch.zeros(rows, self.program.dim, device=dev, dtype=dt)
        self.pos = torch.zeros(rows, device=dev, dtype=torch.long)
        self.pos_offset = torch.zeros(rows, device=dev, dtype=torch.long)
        self.phase = torch.zeros(rows, device=dev, dtype=torch.long)
        self.kind = torch.zeros(rows, device=dev, dtype=torch.long)
        self.first = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.active = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.temperature = torch.zeros(rows, device=dev, dtype=torch.float32)
        self.top_p = torch.ones(rows, device=dev, dtype=torch.float32)
        self.seed = torch.zeros(rows, device=dev, dtype=torch.long)    # sampling rows' seeds
        self.drawn = torch.zeros(rows, device=dev, dtype=torch.long)
        self.out = torch.zeros(rows, 4, device=dev, dtype=torch.long)
        # which rows picked a stop token (ops/row_stop.py: their run ends at that step's
        # commit), by their task's stop tokens and the phases that stop on them
        self.stopped = torch.zeros(rows, device=dev, dtype=torch.int32)
        self.stop_ids = torch.full((rows, MAX_STOP_IDS), -1, device=dev, dtype=torch.long)
        self.stop_phases = torch.zeros(rows, device=dev, dtype=torch.int32)
        self.row_ids = torch.arange(rows, device=dev)
        self.phase_next = torch.tensor(spec.phase_next, device=dev, dtype=torch.long)
        self.generators: list = [None] * rows      # eager (CPU) seeded sampling, per row
        self.eager = EagerBackend(spec, w, kv, use_sdpa(options.attention, dev))
        self.fused = None
        if use_fused(options.fused, dev, dt):
            from ..ops.pdl import gdc_available
            from .fused_backend import FusedBackend, auto_pdl_rows
            auto = options.pdl == "auto"      # where griddepcontrol exists (Hopper+)
            pdl = gdc_available(self.hidden) if auto else options.pdl
            self.fused = FusedBackend(spec, w, kv, rows, deterministic=options.deterministic,
                                      pdl=pdl,
                                      pdl_rows=auto_pdl_rows(spec.program) if auto else None,
                                      share_weights=first_on_weights)
        self.backend = self.fused or self.eager
        # (after the fused backend: the views it put in w too)
        weight_layout.hold(program_tensors(self.program, w))
        self.megakernel, self.megakernel_fallback = None, ""
        spec = options.megakernel
        if spec == "auto":                    # on where measured to win (megakernel_backend)
            try:
                from ..megakernel.megakernel_backend import auto_spec
                spec = auto_spec(self.fused)
            except ImportError:               # no triton: the fused backend is off too
                spec = "off"
        if spec != "off":
            from ..megakernel.megakernel_backend import pick_backend
            self.megakernel, self.megakernel_fallback = pick_backend(self.fused, self, spec)
            self.backend = self.megakernel or self.backend

    def set_row(self, row: int, hidden: torch.Tensor, pos: int, phase: int, kind: int,
                temperature: float, top_p: float, generator=None,
                seed: int | None = None, offset: int = 0, stop_ids=(),
                stop_phases: int = 0) -> None:
        """Called by start() after the prefill (device writes, no host sync): ops/row_setup.py
        (one launch on CUDA, ROW_SETUP_KERNEL; else its torch form). stop_ids / stop_phases:
        the lm picks that end the task and the phases (a bit each) where they do
        (ops/row_stop.py; none: the row never counts as stopped)."""
        setup = row_setup if ROW_SETUP_KERNEL and HAVE_TRITON and self.hidden.is_cuda \
            else row_setup_reference
        setup(self, row, hidden, pos, phase, kind, temperature, top_p, seed=seed,
              offset=offset, stop_ids=stop_ids, stop_phases=stop_phases)
        if seed is None and temperature > 0 and self.seed.is_cuda:
            # an unseeded sampling row: its seed from the CUDA generator (torch.manual_seed
            # repeats it), no host sync; a greedy row reads no seed
            self.seed[row:row + 1].random_(0, 2 ** 31)
        # (on the CPU, sampling rows draw with their torch.Generator: the seed is unused)
        self.generators[row] = generator

    @classmethod
    def of_spec(cls, spec, weights, rows: int, capacity: int, options=None) -> "StepState":
        """A StepState over its own state cache for a bare step spec and its weights (no
        family view: tests, benchmarks, compile checks)."""
        from types import SimpleNamespace
        w0 = next(iter(weights.values()))
        emb = weights.get(dict(spec.program.feedback.weights)["wte"], w0)
        fam = SimpleNamespace(spec=spec, weights=weights, device=emb.device, dtype=emb.dtype)
        kv = StaticKVCache.for_program(spec.program, rows, capacity, emb.device, emb.dtype)
        return cls(fam, rows, kv, options)

    def prefill_tokens(self, row: int, start: int, ids: torch.Tensor, offset: int = 0,
                       backend=None) -> torch.Tensor:
        """Token ids [T] at positions start.. of `row` through a backend's prefill of the
        step program (default the eager one; unpadded, not graphed), the inputs made by the
        family's feedback embedding. Returns every token's hidden state [T, dim]."""
        from .eager_backend import embed_ids
        dev = self.hidden.device
        ids = ids.to(dev)
        inputs = embed_ids(self.eager.feedback, ids)
        pos = start + torch.arange(ids.shape[0], device=dev)
        r = torch.tensor([row], device=dev)
        off = torch.tensor([offset], device=dev)
        return (backend or self.eager).prefill(inputs.pop("x"), r, pos, off, extra=inputs)

    def prefill_eager(self, row: int, start: int, prompt: list[int], offset: int = 0
                      ) -> torch.Tensor:
        """A prompt of any length through the eager backend's prefill of the step program
        (unpadded, not graphed): the runtime's long-prompt prefill for families without
        their own. Returns the last token's hidden state."""
        return self.prefill_tokens(row, start, torch.tensor(prompt), offset)[-1]


def use_fused(fused: str, device, dtype) -> bool:
    """EngineOptions.fused: "auto" = the fused backend on CUDA for bf16/fp16 models when
    triton imports; the eager backend elsewhere (the CPU, and fp32, where outputs must equal
    the reference path's bit for bit). "on" / "off" force it."""
    if fused == "off":
        return False
    if fused == "on":
        return HAVE_TRITON
    return (HAVE_TRITON and torch.device(device).type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def use_sdpa(attention: str, device) -> bool:
    """EngineOptions.attention: "sdpa" | "matmul" | "auto" (SDPA on CUDA, matmul on the CPU)."""
    return attention == "sdpa" or (attention == "auto" and torch.device(device).type == "cuda")


# -- sample pieces ----------------------------------------------------------------------
def _lm_logits(st: StepState, b: int) -> torch.Tensor:
    logits = st.backend.head_logits("lm", st.hidden[:b])
    aid = st.spec.answer_id
    if aid is not None:  # text rows after their first pick never pick the answer marker again
        mask = (st.phase[:b] == st.spec.answer_phase) & ~st.first[:b]
        col = logits[:, aid]
        logits[:, aid] = torch.where(mask, torch.full_like(col, float("-inf")), col)
    return logits


def head(name: str):
    """The greedy piece of one of the program's heads."""
    def piece(st: StepState, b: int) -> None:
        st.backend.head_pick(name, st, b)
    piece.__name__ = f"head_{name}"
    return piece


lm_greedy = head("lm")


def lm_sample(st: StepState, b: int) -> None:
    """Temperature / top-p rows sample, the others take the argmax (graph-capturable; the
    GPU path's sampler: a row's draw depends only on its seed and position)."""
    logits = _lm_logits(st, b)
    greedy = logits.argmax(dim=-1)
    temp = st.temperature[:b]
    probs = torch.softmax(logits.float() / temp.clamp_min(1e-6)[:, None], dim=-1)
    sp, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sp, dim=-1) - sp
    top_p = st.top_p[:b, None]
    keep = (before <= top_p) | (top_p >= 1.0)
    sp = sp * keep
    sp = sp / sp.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(probs).scatter(-1, order, sp)
    if triton_on(probs):  # seeded by the row's seed and position (ops/seeded_sample.py)
        from ..ops.seeded_sample import seeded_sample
        drawn = seeded_sample(probs, st.seed[:b], st.pos[:b], st.drawn[:b])
    else:                 # the process's CUDA generator: a task's seed is not honoured
        drawn = torch.multinomial(probs, 1).squeeze(-1)
    st.out[:b, 0] = torch.where(temp > 0, drawn, greedy)


def lm_sample_eager(st: StepState, b: int) -> None:
    """CPU path: each sampling row draws with its own seeded generator, exactly like the
    reference (ops/sampling.py sample on that row's logits)."""
    from ..ops.sampling import sample

    logits = _lm_logits(st, b)
    toks = logits.argmax(dim=-1)
    temps = st.temperature[:b].tolist()
    tops = st.top_p[:b].tolist()
    for i in range(b):
        if temps[i] > 0:
            toks[i] = sample(logits[i], temps[i], tops[i], st.generators[i])
    st.out[:b, 0] = toks


# -- forward piece ----------------------------------------------------------------------
def forward(st: StepState, b: int, attn_len: int | None = None) -> None:
    """Feed the sampled values back and advance every active row by one position."""
    st.backend.forward(st, b, attn_len or st.kv.capacity)
