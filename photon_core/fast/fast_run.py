"""One task on the fast path: prefill into its row, then the host's side of each step.

The runtime knows no model family: the task's prompt, its prefix state, the long-prompt
prefill and the host side of its skill protocol (which heads a step needs, how a committed
step's sampled values are applied, the objects at the end) come from the family
(fast_family.py: FastFamily, TaskProtocol).

The GPU advances a row on its own (decode_step.py). The host keeps a mirror of the row's
phase (the protocol's next_phase) to know which heads a step needs, and applies each
committed step with the same rules as the family's reference path, shifted by one step: the
value the reference picks at the END of step s is sampled on the GPU at the START of step
s+1 (together with step s+1's forward), so the host learns "stop" one step late. That step is
then a zombie: its forward is discarded, and `steps` counts exactly the reference's steps.

Primitives the protocol's commit uses: end(reason), emit(token) (to the detokenizer),
steps, pos (the reference position after `steps` steps), capacity.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..streaming import TextStreamer
from ..task import Task, TaskError, TaskResult, build_result


class FastRun:
    def __init__(self, engine, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        fam = engine.family
        self.engine, self.enc, self.task = engine, enc, task
        self.ignore_eos = ignore_eos
        # PrefixState (checked by the family; built on the engine's stream, behind an encode
        # that may still run there: FastEngine.start of an image does not wait for it)
        with engine._compute_stream_ctx(), torch.inference_mode():
            prefix = fam.prefix(enc)
        prompt = fam.prompt(task, enc)
        start = prefix.length
        limit = min(fam.max_context, engine.kv.capacity)
        if start + len(prompt) + 1 > limit:
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {start}-token image "
                            f"prefix it does not fit the {fam.max_context}-token context "
                            f"(fast path KV capacity {engine.kv.capacity})")
        # the host side of the skill protocol; room: positions left after the prompt
        self.proto = proto = fam.task_protocol(task, ignore_eos, limit - start - len(prompt))
        self.is_text = proto.text
        self.stream = stream if proto.streams else None
        self.kind = proto.kind
        # the reference's capacity rule; the static cache may cap it further
        self.capacity = min(fam.max_context, start + len(prompt) + proto.budget,
                            engine.kv.capacity)

        self.finish_reason: str | None = None
        self.steps = 0
        self.phase = proto.first_phase                # phase of the next launch
        self.streamer = TextStreamer(fam.decode)
        self.text_done = threading.Event()
        if not self.is_text:
            self.text_done.set()
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}
        self.launched = 0          # steps launched that include this run
        self.final_launched = False  # the step whose commit surely ends the run is launched
        self.committed = 0         # of which committed
        self.row: int | None = None
        self.pos = start + len(prompt)   # reference position after `steps` steps
        self._objects = None

        generator = None
        if proto.seed is not None:
            generator = torch.Generator(device=fam.device).manual_seed(proto.seed)
        self.row = engine._acquire_row(self)
        t0 = time.perf_counter()
        try:
            self._prefill(engine, fam, prefix, prompt, generator)
        except BaseException:
            self.finish_reason = "error"
            engine._run_finished(self)
            raise
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        engine._started(self)

    def _prefill(self, engine, fam, prefix, prompt, generator) -> None:
        proto = self.proto
        with engine._compute_stream_ctx(), torch.inference_mode():
            start = engine.kv.load_prefix(self.row, prefix)
            offset = prefix.position_offset
            last = None
            if engine.prefill is not None and engine.prefill.bucket(len(prompt)):
                last = engine.prefill.run(self.row, start, prompt, offset)   # graphed_prefill
            else:
                last = fam.prefill_long(engine.kv, self.row, start, prompt, self.enc)
                if last is None:                  # the step program over the whole prompt
                    last = engine.state.prefill_eager(self.row, start, prompt, offset)
            stop_ids, stop_phases = proto.stops()
            engine.state.set_row(self.row, last, self.pos, self.phase, self.kind,
                                 proto.temperature, proto.top_p, generator,
                                 seed=proto.seed % 2 ** 63 if proto.seed is not None
                                 else None, offset=offset, stop_ids=stop_ids,
                                 stop_phases=stop_phases)

    # -- public (TaskRunLike) -----------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        return self.streamer.text

    @property
    def objects(self) -> list[dict]:
        return self._objects if self._objects is not None else []

    def step(self) -> bool:
        """One pipelined decode step of this run alone (engine.step_batch([self]))."""
        return self.engine.step_batch([self])[0]

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self.end(reason)

    def result(self, timeout: float | None = 30.0) -> TaskResult:
        if not self.finished:
            raise RuntimeError("result() before the task finished; step() it or cancel() it")
        if not self.text_done.wait(timeout):
            raise TimeoutError("the detokenizer thread did not finish this run's text")
        if self._objects is None:          # once: a parse may count its errors
            self._objects = self.proto.objects(self.streamer.text, self.finish_reason)
            # an encode returned before it ran (start() of an image): its GPU time now
            if getattr(self.enc, "gpu_timing", None) is not None:
                self.timings["encode_ms"] = self.enc.gpu_encode_ms()
        return build_result(self.task, self._objects, self.streamer.text, self.finish_reason,
                            self.steps, self.timings)

    # -- used by the pipelined decoder ----------------------------------------------------
    def heads(self) -> tuple[str, ...]:
        """The sample pieces the next launched step needs for this run."""
        return self.proto.heads(self.phase)

    def launched_step(self) -> int:
        """Advance the host's phase mirror exactly as the GPU advances the row."""
        ph = self.phase
        if self.launched == 0:
            self._t_first_launch = time.perf_counter()
        self.phase = self.proto.next_phase(ph)
        self.launched += 1
        self.final_launched = self.proto.launched(self, ph)
        return ph

    def commit(self, phase: int, out: list[int]) -> None:
        """Apply one committed step's sampled values (out: the step's `out` row)."""
        self.committed += 1
        if self.finished:
            return                         # a zombie: discard
        self.proto.commit(self, phase, out)

    # -- primitives of the family's protocol --------------------------------------------
    def emit(self, token: int) -> None:
        self.engine.detok.token(self, token)

    def end(self, reason: str) -> None:
        self.finish_reason = reason
        if self.launched:   # wall time from the first launch to the commit that ended it
            self.timings["decode_ms"] = (time.perf_counter() - self._t_first_launch) * 1e3
        if self.is_text:
            self.engine.detok.finish(self)
        self.engine._run_finished(self)
