"""One task on the fast path: prefill into its row, then the host's side of each step.

The GPU advances a row on its own (decode_step.py). The host keeps a mirror of the row's
phase (the skill protocol's tables, models/moondream2/skill_protocol.py) to know which heads a
step needs, and applies each committed step with the same rules as the reference path
(models/moondream2/run.py), shifted by one step: the value
the reference picks at the END of step s is sampled on the GPU at the START of step s+1
(together with step s+1's forward), so the host learns "stop" one step late. That step is
then a zombie: its forward is discarded, and `steps` counts exactly the reference's steps.

Commit rules (phase at launch -> what the host does with the row's sampled values):
  text: token == eos -> stop | position at capacity -> length | else emit it, steps += 1,
        and max_tokens reached -> length
  x:    token == eos -> stop | objects == max_objects -> length | capacity -> length |
        else remember x, steps += 1
  y:    remember y, steps += 1; point: append {x, y}
  size: append the box (center +- size / 2), steps += 1
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..models.moondream2 import region, text
from ..models.moondream2 import skill_protocol as sp
from ..models.moondream2.skill_protocol import (OUT_COORD, OUT_H, OUT_TOKEN, OUT_W, PHASE_SIZE,
                                                PHASE_TEXT, PHASE_X, PHASE_Y)
from ..models.moondream2.streaming import TextStreamer
from ..task import FINISH_LENGTH, FINISH_STOP, Task, TaskError, TaskResult, build_result


class FastRun:
    def __init__(self, engine, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        model = engine.model
        cfg, w = model.config, model.weights
        self.engine, self.enc, self.task, self.stream = engine, enc, task, stream
        self.ignore_eos = ignore_eos
        self.is_text = sp.is_text(task.skill)
        self.kind = sp.row_kind(task.skill)
        prompt = model.tokenizer.prompt(task.skill, task.target)
        prefix = enc.kv.shape[4]
        if prefix + len(prompt) + 1 > min(cfg.text.max_context, engine.kv.capacity):
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {prefix}-token image "
                            f"prefix it does not fit the {cfg.text.max_context}-token context "
                            f"(fast path KV capacity {engine.kv.capacity})")
        # the reference's capacity rule; the static cache may cap it further
        self.capacity = min(cfg.text.max_context, prefix + len(prompt) + sp.step_budget(task),
                            engine.kv.capacity)
        self.eos_id = cfg.tokenizer.eos_id
        self.coord_bins = cfg.region.coord_out_dim
        self.size_bins = cfg.region.size_out_dim // 2

        self.finish_reason: str | None = None
        self.steps = 0
        self.region = sp.RegionCollector(task.skill)
        self.objects = self.region.objects
        self.phase = sp.first_phase(task.skill)                 # phase of the next launch
        self.streamer = TextStreamer(model.tokenizer.decode)
        self.text_done = threading.Event()
        if not self.is_text:
            self.text_done.set()
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}
        self.launched = 0          # steps launched that include this run
        self.final_launched = False  # the step whose commit surely ends the run is launched
        self._objects_launched = 0
        self.committed = 0         # of which committed
        self.row: int | None = None
        self.pos = prefix + len(prompt)   # reference position after `steps` steps

        generator = None
        if task.seed is not None and self.is_text:
            generator = torch.Generator(device=w.device).manual_seed(task.seed)
        self.row = engine._acquire_row(self)
        t0 = time.perf_counter()
        try:
            self._prefill(engine, cfg, w, prompt, prefix, generator)
        except BaseException:
            self.finish_reason = "error"
            engine._run_finished(self)
            raise
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        engine._started(self)

    def _prefill(self, engine, cfg, w, prompt, prefix, generator) -> None:
        task, model, enc = self.task, engine.model, self.enc
        with engine._compute_stream_ctx(), torch.inference_mode():
            cache = engine.kv.row_cache(self.row)
            cache.load_prefix(enc.kv)
            if engine.prefill is not None and engine.prefill.bucket(len(prompt)):
                last = engine.prefill.run(self.row, prefix, prompt)     # graphed_prefill.py
            else:                                                        # the reference's
                ids = torch.tensor([prompt], device=w.device)
                last = text.decoder(w, cfg.text, text.embed(w, ids), prefix, cache,
                                    model.prefix_len)[0, -1]
            engine.state.set_row(self.row, last, self.pos, self.phase,
                                 self.kind, task.temperature if self.is_text else 0.0,
                                 task.top_p if self.is_text else 1.0, generator,
                                 seed=task.seed % 2 ** 63 if task.seed is not None
                                 else None)

    # -- public (TaskRunLike) -----------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        return self.streamer.text

    def step(self) -> bool:
        """One pipelined decode step of this run alone (engine.step_batch([self]))."""
        return self.engine.step_batch([self])[0]

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self._finish(reason)

    def result(self, timeout: float | None = 30.0) -> TaskResult:
        if not self.finished:
            raise RuntimeError("result() before the task finished; step() it or cancel() it")
        if not self.text_done.wait(timeout):
            raise TimeoutError("the detokenizer thread did not finish this run's text")
        return build_result(self.task, self.objects, self.streamer.text, self.finish_reason,
                            self.steps, self.timings)

    # -- used by the pipelined decoder ----------------------------------------------------
    def heads(self) -> tuple[str, ...]:
        """The sample pieces the next launched step needs for this run."""
        heads = sp.HEADS[self.phase]
        if self.phase == PHASE_TEXT and self.task.temperature > 0:
            return ("lm_sample",)
        return heads

    def launched_step(self) -> int:
        """Advance the host's phase mirror exactly as the GPU advances the row."""
        ph = self.phase
        if self.launched == 0:
            self._t_first_launch = time.perf_counter()
        self.phase = sp.next_phase(ph, self.kind)
        self.launched += 1
        # Known last step: its commit ends the run whatever it holds, so launching another
        # step of this run would only make a zombie.
        if ph == PHASE_TEXT:
            self.final_launched = self.launched >= self.task.max_tokens
        else:
            if ph == PHASE_X:
                self.final_launched = self._objects_launched >= self.task.max_objects
            if sp.ends_object(ph, self.kind):
                self._objects_launched += 1
        return ph

    def commit(self, phase: int, out: list[int]) -> None:
        """Apply one committed step's sampled values (out = [token, coord, w, h] bins)."""
        self.committed += 1
        if self.finished:
            return                         # a zombie: discard
        if phase == PHASE_TEXT:
            tok = out[OUT_TOKEN]
            if tok == self.eos_id and not self.ignore_eos:
                return self._finish(FINISH_STOP)
            if self.pos >= self.capacity:
                return self._finish(FINISH_LENGTH)
            self.steps += 1
            self.engine.detok.token(self, tok)
            if self.steps >= self.task.max_tokens:
                return self._finish(FINISH_LENGTH)
            self.pos += 1
            return
        if phase == PHASE_X:
            if out[OUT_TOKEN] == self.eos_id and not self.ignore_eos:
                return self._finish(FINISH_STOP)
            if len(self.objects) >= self.task.max_objects or self.pos >= self.capacity:
                return self._finish(FINISH_LENGTH)
        if phase in (PHASE_X, PHASE_Y):
            self.region.take(phase, region.bin_to_coordinate(out[OUT_COORD], self.coord_bins))
        else:
            self.region.take(phase, (region.bin_to_size(out[OUT_W], self.size_bins),
                                     region.bin_to_size(out[OUT_H], self.size_bins)))
        self.steps += 1
        self.pos += 1

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.launched:   # wall time from the first launch to the commit that ended it
            self.timings["decode_ms"] = (time.perf_counter() - self._t_first_launch) * 1e3
        if self.is_text:
            self.engine.detok.finish(self)
        self.engine._run_finished(self)
