"""The typed engine contract every layer shares: what an engine is, what a run is, what an
encoded image (the prefix state) holds, and the options an engine is built with.

    engine = photon_core.load_engine(path, device="cuda", dtype="bf16",
                                     options=EngineOptions(fused="auto", max_batch=8))
    enc = engine.encode_image(image)          # -> PrefixState, shared by every task on it
    run = engine.start(enc, task)             # -> Run (prompt prefilled after the prefix)
    alive = engine.step_batch([run, ...])     # one decode step of each run
    run.cancel("deadline"); run.result()      # -> photon_core.task.TaskResult

Engines: a family's reference engine (eager PyTorch, e.g. MoondreamModel), the runtime's
FastEngine (photon_core/fast/), the scheduler's SimEngine, photon_ros' HookedEngine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence, runtime_checkable

from .encode_request import CROP_MODES, check_crops, parse_crops
from .task import SKILLS as ALL_SKILLS
from .task import Task, TaskError, TaskResult

ENGINES = ("auto", "reference", "fast")
CHOICES = ("auto", "on", "off")
ATTENTIONS = ("auto", "sdpa", "matmul")
ENCODERS = ("auto", "reference", "fast")


@dataclass(frozen=True)
class EngineOptions:
    """How an engine is built (given to load_engine / FastEngine; no module globals).

    engine: "reference" (the family's eager engine), "fast" (the runtime: state cache, CUDA
      graphs, pipelined decoding; on the CPU without graphs) or "auto" (fast on CUDA).
    fused: the runtime's step backend: "on" = the fused Triton kernels, "off" = the eager
      (torch) ops, "auto" = fused on CUDA for bf16/fp16 models when triton imports.
    attention: eager backend's decode attention: "sdpa" (masked SDPA, faster on CUDA),
      "matmul" (faster on the CPU), "auto" (per device).
    crops_on_device: image crops on the model's device (torch LANCZOS, bit-identical to PIL)
      or with PIL on the CPU; None = on device when it is CUDA.
    crops: the default crop mode of encode_image / encode_batch: "overlap" (global view +
      local crops), "overlap:N" (at most N local crops) or "global" (the global view only:
      faster, less detail); a frame's
      photon_core.encode_request.EncodeRequest overrides it per frame (per camera).
    encoder: the fast path's image encode: "reference" (the reference's functions, as CUDA
      graphs: bit-identical to the reference encode), "fast" (Moondream 2: fused GELU
      epilogues, prefix attention without the mask; Gemma 4: its fast vision tower, SDPA
      attention and concatenated GEMMs; Qwen 3.5: as "reference" - close, not bitwise),
      "auto" (fast on CUDA).
    deterministic: repeatable bits run to run (no split-K atomics; slightly slower).
    pdl: the fused backend's kernels launch with programmatic dependent launch (Hopper+,
      a Triton with triton.language.extra.cuda.gdc_*; ops/pdl.py): each starts while the one
      before finishes (a GEMV loads its first weights meanwhile). Same results; ignored
      elsewhere (CPU, interpreter, older GPUs). "auto" (the default): on a GPU with the
      griddepcontrol instructions (Hopper+; off elsewhere), for passes of at most
      fused_backend.PDL_AUTO_ROWS rows of the families where it was measured to win
      (fused_backend.auto_pdl_rows: Qwen 3.5 0.8B 1.11x, Gemma 4 E2B 1.14x at one row; not
      at 8 rows, nor for Moondream 2), True: every pass, False: none.
    megakernel: the fast path's decode forward (feedback + decoder + row advance) as one
      persistent megakernel launch per step (photon_core/megakernel): "auto" (the
      default: "on" on a Hopper GPU, sm_90, where it was measured to win; "off" elsewhere),
      "off", "on"
      (the measured best variant at batch 1, where it beats the fused graph: 0.908 vs
      1.100 ms deterministic / 1.024 split-K on the H200; not its bits - the GEMVs sum in
      another order - so greedy tokens can part on near-ties; larger buckets keep the fused
      forward: docs/benchmarks.md),
      or a variant string ("pipe_fma@8x1024/w4/s3/p2", megakernel_step.Variant: every
      bucket it can lower; "auto/w8" = the default GEMV choice).
      Needs the fused backend; where the megakernel cannot serve the model (no lowering
      for the family's ops, no CUDA / cooperative launch) the fused backend runs and the
      reason is logged (FastEngine.metrics()["megakernel_fallback"]).
    max_batch: rows (batch slots) of the fast path; kv_capacity: positions per row
      (None: 1024 on the GPU, the model's context on the CPU).
    """
    engine: str = "auto"
    fused: str = "auto"
    attention: str = "auto"
    crops_on_device: bool | None = None
    crops: str = "overlap"
    encoder: str = "auto"
    deterministic: bool = False
    pdl: bool | str = "auto"
    megakernel: str = "auto"
    max_batch: int = 8
    kv_capacity: int | None = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; expected one of "
                             f"{', '.join(ENGINES)}")
        if self.fused not in CHOICES:
            raise ValueError(f"fused must be one of {CHOICES}, not {self.fused!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, not {self.attention!r}")
        check_crops(self.crops)
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, not {self.encoder!r}")
        if not (isinstance(self.pdl, bool) or self.pdl == "auto"):
            raise ValueError(f"pdl must be a bool or 'auto', not {self.pdl!r}")
        if not isinstance(self.megakernel, str):
            raise ValueError(f"megakernel must be 'auto', 'off', 'on' or a variant string, not "
                             f"{self.megakernel!r}")
        if self.megakernel not in ("auto", "off", "on"):
            try:
                from .megakernel.megakernel_step import Variant
            except ImportError:      # no triton: the engine falls back (and says why)
                Variant = None
            if Variant is not None:
                Variant.parse(self.megakernel)      # ValueError on a bad variant
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, not {self.max_batch!r}")

    def with_(self, **changes) -> "EngineOptions":
        """A copy with the given fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class Capabilities:
    """What a model family serves, known before its weights load (the registry reads the
    checkpoint's config.json: photon_core.models.capabilities(path)) and on every engine
    (`engine.capabilities`: the family's reference engine, FastEngine from its family).

    family: the family name ("moondream2", "qwen3.5", "gemma4"); name: for messages.
    skills: the skills it serves (a subset of photon_core.task.SKILLS).
    crop_modes: the encode crop modes' forms it serves (photon_core.encode_request.
      CROP_MODES): ("overlap",) = whole-image encode only; Moondream 2 also "global" and
      "overlap:N" (a local-crop budget per frame).
    unsupported: the family's own refusal of a skill, with {skill} (and optionally {name},
      {skills}) to fill in; "" = a generic one.
    """
    family: str
    name: str
    skills: frozenset = frozenset(ALL_SKILLS)
    crop_modes: tuple = ("overlap",)
    unsupported: str = ""

    def __post_init__(self):
        object.__setattr__(self, "skills", frozenset(self.skills))
        bad = sorted(set(self.skills) - set(ALL_SKILLS))
        if bad:
            raise ValueError(f"unknown skills {bad} in the capabilities of {self.family}")
        bad = sorted(set(self.crop_modes) - set(CROP_MODES))
        if bad or "overlap" not in self.crop_modes:
            raise ValueError(f"crop modes of {self.family} must include 'overlap' and be among "
                             f"{CROP_MODES}, got {self.crop_modes}")

    def served(self) -> str:
        return ", ".join(s for s in ALL_SKILLS if s in self.skills)

    def skill_refusal(self, skill: str) -> str:
        """"" when the skill is served, else the family's message saying it is not."""
        if skill in self.skills or skill not in ALL_SKILLS:
            return ""       # unknown skills are Task.validate's to refuse
        template = self.unsupported or "{name} does not support {skill}; it serves {skills}"
        return template.format(skill=skill, name=self.name, skills=self.served())

    def serves_crops(self, crops: str) -> bool:
        """Whether the crop mode (e.g. "overlap:4", of the form "overlap:N") is served."""
        try:
            return parse_crops(crops)[0] in self.crop_modes
        except ValueError:
            return False

    def crops_refusal(self, crops: str) -> str:
        """"" when the crop mode is served, else why not."""
        try:
            if parse_crops(crops)[0] in self.crop_modes:
                return ""
        except ValueError:
            return ""       # unknown modes are check_crops' to refuse
        return (f"{self.name} does not support crops {crops!r}: it encodes the whole image "
                f"(crop modes: {', '.join(self.crop_modes)}; 'global' and 'overlap:N' are "
                "Moondream 2's)")

    def check_skill(self, skill: str) -> None:
        """TaskError with the family's message when the skill is not served."""
        why = self.skill_refusal(skill)
        if why:
            raise TaskError(why)


class GpuTiming:
    """gpu_encode_ms() of an encoding with a `gpu_timing` field: (start event, end event,
    share) of an encode returned before the GPU ran it, or None."""

    def gpu_encode_ms(self) -> float:
        """encode_ms, or with gpu_timing the GPU's time of the encode (waits for it)."""
        if self.gpu_timing is None:
            return self.encode_ms
        start, end, share = self.gpu_timing
        end.synchronize()
        return start.elapsed_time(end) * share

    @staticmethod
    def start_event():
        """A CUDA timing event recorded now on the current stream: where a queued encode's
        device work begins."""
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def timing(start, share: float = 1.0) -> tuple:
        """gpu_timing of an encode queued since `start` (start_event): (start, an end event
        recorded now, this encoding's share of the work between them)."""
        return (start, GpuTiming.start_event(), share)


@dataclass(frozen=True, kw_only=True)
class PrefixState(GpuTiming):
    """An encoded image: the decoder's state after the image prefix, shared read-only by every
    task started on it (each task copies it into its own cache row).

    kv: attention k/v of the prefix tokens, [n_attention_layers, 2, 1, n_kv_heads, T, head_dim]
      (T: any number of prefix tokens; None for a family without attention layers), or a
      tuple of [2, 1, Hkv_i, T, D_i] per attention layer (layers of their own shapes).
    recurrent: per recurrent layer (e.g. Gated DeltaNet), its state after the prefix
      (family-defined tensors; () for pure-attention families such as Moondream 2).
    n_tokens: T when kv is None.
    position_offset: the rotary position of cache position p is p + position_offset (0; Qwen
      3.5's M-RoPE: an image of gh x gw merged tokens advances the text position by
      max(gh, gw), not by gh * gw).
    n_crops: image units the encoder ran (the scheduler's encode cost hint).
    setup_ms: of encode_ms, one-time work of this call (a graph capture), left out of costs.
    gpu_timing: (start event, end event, share) of an encode returned before the GPU ran it
      (FastEngine.encode_image(sync=False)): encode_ms is then the host's time, and
      gpu_encode_ms() the GPU's between the events (this image's share of the call), once
      the encode has run.
    """
    model_id: str
    kv: Any = None
    recurrent: tuple = ()
    n_tokens: int = 0
    position_offset: int = 0
    width: int = 0
    height: int = 0
    n_crops: int = 1
    encode_ms: float = 0.0
    setup_ms: float = 0.0
    gpu_timing: Any = None

    @property
    def length(self) -> int:
        """Prefix tokens (positions the prompt starts after)."""
        if self.kv is None:
            return self.n_tokens
        return int(self.kv.shape[4]) if hasattr(self.kv, "shape") else int(self.kv[0].shape[-2])


@runtime_checkable
class Run(Protocol):
    """One task on one encoded image, advanced a decode step at a time."""

    @property
    def finished(self) -> bool: ...

    def step(self) -> bool:
        """One decode step; False once finished."""

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop; result() then carries finish_reason `reason` ("cancelled" / "deadline")."""

    def result(self) -> TaskResult: ...


@runtime_checkable
class Engine(Protocol):
    """What the scheduler and the node drive."""

    model_id: str
    # most runs open at once (the fast path's rows); None: no limit
    max_runs: int | None
    # the family's skills and crop modes (refuse the rest at configuration time)
    capabilities: Capabilities

    def encode_image(self, image: Any) -> Any:
        """-> PrefixState (or the engine's own encoded-image type), shared by its tasks."""

    def start(self, enc: Any, task: Task) -> Run:
        """Prefill the task prompt after the shared image prefix."""

    def step_batch(self, runs: Sequence[Run]) -> list[bool]:
        """One decode step of every run; per run, whether it is still going."""

    def count_prompt_tokens(self, task: Task) -> int:
        """Prompt tokens the task prefills after the image prefix (a cost hint)."""


__all__ = ["ATTENTIONS", "CHOICES", "Capabilities", "ENCODERS", "ENGINES", "Engine", "EngineOptions", "GpuTiming", "PrefixState", "Run"]
