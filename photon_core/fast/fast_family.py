"""The runtime's plugin boundary: what a model family hands the fast path (FastEngine,
fast_run, the pipelined decoder, the state cache) so that the runtime itself knows no family.

A family's reference engine provides `fast_family()` -> an object with the FastFamily
interface below (Moondream 2: models/moondream2/fast_family.py; Qwen 3.5:
models/qwen3_5/fast_family.py). The runtime only ever calls these:

  spec               StepSpec: the step program, the skill protocol's phase table, the
                     answer-marker rule, feedback tables (photon_core/program.py)
  weights            name -> tensor (the program's weight names), on the model's device
  device, dtype      of the weights (the state cache and row buffers use them)
  max_context        positions one task may use (image prefix + prompt + answer)
  prefix(enc)        an encoded image (the family's own type) -> PrefixState: k/v of the
                     attention layers, recurrent states, position_offset; a ValueError when
                     the image was made by a different model
  prompt(task, enc)  the task's prompt tokens, prefilled after the prefix
  count_prompt_tokens(task)   a cost hint for the scheduler
  task_protocol(task, ignore_eos, room)   the host side of the task's skill protocol
                     (TaskProtocol); room: positions left after prefix + prompt
  decode(ids)        token ids -> text (the streamer's detokenizer)
  make_encoder(use_graphs, fast)   the fast image encoder (an object with encode(image) and
                     capture_stream / capture_ms), or None: the reference encode_image;
                     fast: the family's fast encode form where it has one (not bitwise)
  encode_image(image)         the reference encode (used when make_encoder gives None)
  make_batch_encoder(use_graphs, fast, max_frames, default_crops)   the batched encoder
                     (encode(image, crops) / encode_batch(images, crops) / prepare(shapes,
                     batch_sizes, crops): several frames in one vision pass + one prefix
                     prefill, crop modes), or None: frames are encoded one by one, whole
  prefill_long(kv, row, start, prompt, enc)   the prefill of a prompt longer than the
                     largest graphed bucket, or None: the eager backend's prefill of the
                     step program over the whole prompt (generic)

TaskProtocol (one task, host side; the GPU side is the phase table and the heads):
  text               its tokens go through the detokenizer (streamed or parsed at the end)
  streams            the stream callback sees the text deltas
  first_phase, kind  the row's phase at start and its row kind (a column of the phase table)
  budget             decode steps it may take (sizes its positions)
  temperature, top_p, seed   sampling of its text phase (0.0 / 1.0 / None: greedy)
  heads(phase)       the sample pieces a step of this phase needs ("lm", "lm_sample", ...)
  next_phase(phase)  the host mirror of the GPU's row advance
  launched(run, phase) -> bool   a step of `phase` was launched; True when its commit surely
                     ends the task (launching another step would only make a zombie)
  commit(run, phase, out)   apply one committed step's sampled values through the run's
                     primitives (run.end(reason), run.emit(token), run.steps, run.pos,
                     run.capacity)
  objects(text, finish_reason)   the task's objects when it ends (detect / point)

TextTask is the protocol of a token-feedback text skill (query / caption of every family,
the toy family's, Qwen's grounding answers): one phase, each step's token is emitted, a stop
id ends it, the budget ends it with "length".
"""
from __future__ import annotations

import weakref

from typing import Any, Protocol, Sequence

from ..task import FINISH_LENGTH, FINISH_STOP, Task


class TaskProtocol(Protocol):
    text: bool
    streams: bool
    first_phase: int
    kind: int
    budget: int
    temperature: float
    top_p: float
    seed: int | None

    def heads(self, phase: int) -> tuple[str, ...]: ...

    def stops(self) -> tuple[tuple[int, ...], int]: ...   # lm picks that end it, phase bits

    def next_phase(self, phase: int) -> int: ...

    def launched(self, run, phase: int) -> bool: ...

    def commit(self, run, phase: int, out: Sequence[int]) -> None: ...

    def objects(self, text: str, finish_reason: str) -> list[dict]: ...


class FastFamily(Protocol):
    spec: Any
    weights: Any
    device: Any
    dtype: Any
    max_context: int

    def prefix(self, enc) -> Any: ...

    def prompt(self, task: Task, enc) -> list[int]: ...

    def count_prompt_tokens(self, task: Task) -> int: ...

    def task_protocol(self, task: Task, ignore_eos: bool, room: int) -> TaskProtocol: ...

    def decode(self, ids: list[int]) -> str: ...

    def make_encoder(self, use_graphs: bool, fast: bool = False): ...

    def encode_image(self, image) -> Any: ...

    def make_batch_encoder(self, use_graphs: bool, fast: bool, max_frames: int,
                           default_crops: str): ...

    def prefill_long(self, kv, row: int, start: int, prompt: list[int], enc): ...


class ReferenceEncodeFamily:
    """The shared part of a FastFamily whose frames go through the reference engine's
    encode_image (as CUDA graphs where the model splits it in three; no batched encoder of
    its own yet) and whose long prompts take the runtime's generic prefill. An encoded
    image's PrefixState is built once (`_build_prefix`, the family's) and shared by the
    image's tasks; it is forgotten with the image. A family says which EncodedImage it made
    in `_made_here`."""

    def __init__(self, model, spec):
        self.model = model
        self.spec = spec
        self.weights = model.weights
        self.device, self.dtype = model.device, model.dtype
        self.max_context = model.max_context
        self._prefixes: dict[int, Any] = {}          # id(enc) -> its PrefixState

    def make_encoder(self, use_graphs: bool, fast: bool = False):
        """The reference encode as a CUDA graph per layout where the model splits its
        encode_image (encode_inputs / encode_body / encode_result:
        graphed_reference_encoder.py); fast: with the model's encode_body_fast where it has
        one (Gemma 4: the fast vision tower); else None: the reference encode_image."""
        if use_graphs and hasattr(self.model, "encode_body"):
            from .graphed_reference_encoder import GraphedReferenceEncoder
            body = getattr(self.model, "encode_body_fast", None) if fast else None
            return GraphedReferenceEncoder(self.model, use_graphs, body=body)
        return None

    def make_batch_encoder(self, *args, **kwargs):
        return None                                   # whole images, one by one

    def prefill_long(self, kv, row: int, start: int, prompt: list[int], enc):
        return None                                   # the runtime's generic prefill

    def encode_image(self, image):
        return self.model.encode_image(image)

    def prefix(self, enc):
        if getattr(enc, "model_id", None) != self.model.model_id or not self._made_here(enc):
            raise ValueError("this EncodedImage was made by a different model")
        p = self._prefixes.get(id(enc))
        if p is None:
            p = self._prefixes[id(enc)] = self._build_prefix(enc)
            weakref.finalize(enc, self._prefixes.pop, id(enc), None)
        return p

    def _made_here(self, enc) -> bool:
        raise NotImplementedError

    def _build_prefix(self, enc):
        raise NotImplementedError


def fast_family(model) -> FastFamily:
    """A model (reference engine) -> its runtime view; a FastFamily is returned as is."""
    make = getattr(model, "fast_family", None)
    if make is None:
        raise TypeError(f"{type(model).__name__} provides no fast_family(): the fast path does "
                        "not serve this model family")
    return make()


class TextTask:
    """A token-feedback text skill, host side (phase `phase` only; row kind `kind`).

    commit of a step: its token in stop_ids (and not ignore_eos) -> stop; position at
    capacity -> length; else the token is emitted, steps += 1, and budget reached or
    until(token) -> length (the reference's rule, models/task_run_base.py).
    Sampling rows (temperature > 0) take the "lm_sample" piece, the others "lm"."""

    streams = True

    def __init__(self, task: Task, stop_ids, budget: int, ignore_eos: bool = False,
                 sampled: bool = True, phase: int = 0, kind: int = 0, streams: bool = True,
                 parse=None, until=None):
        """sampled: the task's temperature / top_p / seed apply (False: greedy); parse:
        text, finish_reason -> objects (a skill answered in text, e.g. grounding JSON);
        until: token -> True once the task has what it asked for (called once per emitted
        token, in order; grounding_json.token_cap)."""
        self.task, self.stop_ids, self.budget = task, frozenset(stop_ids), budget
        self.ignore_eos = ignore_eos
        self.text, self.streams = True, streams
        self.first_phase, self.kind, self.phase = phase, kind, phase
        self.temperature = task.temperature if sampled else 0.0
        self.top_p = task.top_p if sampled else 1.0
        self.seed = task.seed if sampled else None
        self._parse = parse
        self.until = until

    def heads(self, phase: int) -> tuple[str, ...]:
        return ("lm_sample",) if self.temperature > 0 else ("lm",)

    def stops(self) -> tuple[tuple[int, ...], int]:
        """(the lm picks that end the task on the GPU's view, a bit per phase where they do):
        the stop ids in this task's phase; none when eos is ignored (ops/row_stop.py)."""
        return ((), 0) if self.ignore_eos else (tuple(sorted(self.stop_ids)), 1 << self.phase)

    def next_phase(self, phase: int) -> int:
        return self.phase

    def launched(self, run, phase: int) -> bool:
        return run.launched >= self.budget

    def commit(self, run, phase: int, out) -> None:
        tok = out[0]
        if tok in self.stop_ids and not self.ignore_eos:
            return run.end(FINISH_STOP)
        if run.pos >= run.capacity:
            return run.end(FINISH_LENGTH)
        run.steps += 1
        run.emit(tok)
        if run.steps >= self.budget or (self.until is not None and self.until(tok)):
            return run.end(FINISH_LENGTH)
        run.pos += 1

    def objects(self, text: str, finish_reason: str) -> list[dict]:
        return [] if self._parse is None else self._parse(text, finish_reason)


__all__ = ["FastFamily", "TaskProtocol", "TextTask", "fast_family"]
