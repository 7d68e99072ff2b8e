"""One task on one encoded frame, advanced one decode step at a time (Qwen 3.5 reference).

start: copy the frame's prefix state (attention k/v + DeltaNet conv/recurrent states) into a
private state with room for prompt + budget, prefill the task's prompt after it, pick the first
token. Each step() emits the current token (query/caption: streamed as word-safe deltas),
feeds it (one decoder forward) and picks the next. Stops at <|im_end|> / <|endoftext|>, or at
the budget: max_tokens for query/caption; for detect/point enough tokens for max_objects
JSON entries. detect/point are greedy; their text is parsed by grounding_json at the end
(a malformed answer: empty result, `parse_error` set and counted in model.stats).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..grounding_json import parse_grounding
from ._shared import (FINISH_LENGTH, FINISH_STOP, Task, TaskError, TaskResult, TextStreamer,
                      build_result, sample)
from . import decoder

TOKENS_PER_OBJECT = 40   # a real-tokenizer JSON box entry is ~30 tokens (digits one by one)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TaskRun:
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        self.model, self.enc, self.task, self.stream = model, enc, task, stream
        self.ignore_eos = ignore_eos
        self.is_text = task.skill in ("query", "caption")
        cfg, w = model.config.text, model.weights
        prompt = model.prompts.task(task.skill, task.target, enc.prefix_text)
        budget = task.max_tokens if self.is_text else TOKENS_PER_OBJECT * task.max_objects + 16
        prefix = enc.state.length
        limit = model.max_context
        if prefix + len(prompt) + 1 > limit:
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {prefix}-token image "
                            f"prefix it does not fit the {limit}-token context")
        self.budget = min(budget, limit - prefix - len(prompt))
        self.generator = None
        if task.seed is not None and self.is_text:
            self.generator = torch.Generator(device=w["lm_head.weight"].device).manual_seed(task.seed)
        self.finish_reason: str | None = None
        self.steps = 0
        self.tokens: list[int] = []
        self.objects: list[dict] = []
        self.parse_error: str | None = None
        self.streamer = TextStreamer(model.prompts.decode)
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}

        t0 = time.perf_counter()
        with torch.inference_mode():
            self.state = enc.state.copy(prefix + len(prompt) + self.budget + 1)
            self.next_token = self._forward(prompt)
        self._check_end()
        _sync(model.device)
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3

    # -- public ---------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        return self.streamer.text + self.streamer.pending()

    def step(self) -> bool:
        if self.finished:
            return False
        t0 = time.perf_counter()
        self.steps += 1
        token = self.next_token
        self.tokens.append(token)
        self._emit(self.streamer.push(token))
        if self.steps >= self.budget:
            self._finish(FINISH_LENGTH)
        else:
            with torch.inference_mode():
                self.next_token = self._forward([token])
            self._check_end()
        _sync(self.model.device)
        self.timings["decode_ms"] += (time.perf_counter() - t0) * 1e3
        return not self.finished

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self._finish(reason)

    def result(self) -> TaskResult:
        if not self.finished:
            raise RuntimeError("result() before the task finished; step() it or cancel() it")
        return build_result(self.task, self.objects, self.streamer.text, self.finish_reason,
                            self.steps, self.timings)

    # -- mechanics ------------------------------------------------------------------------
    def _forward(self, ids: list[int]) -> int:
        m, st = self.model, self.state
        x = decoder.embed(m.weights, torch.tensor(ids, device=m.device))
        pos = decoder.text_positions(st.rope_pos, len(ids), m.device)
        hidden = decoder.forward(m.weights, m.config.text, x, pos, st)
        st.rope_pos += len(ids)
        logits = decoder.logits(m.weights, hidden[-1])
        if not self.is_text or self.task.temperature == 0:
            return int(logits.argmax())
        return sample(logits, self.task.temperature, self.task.top_p, self.generator)

    def _check_end(self) -> None:
        if self.next_token in self.model.prompts.stop_ids and not self.ignore_eos:
            self._finish(FINISH_STOP)

    def _emit(self, delta: str) -> None:
        if delta and self.stream is not None and self.is_text:
            self.stream(delta)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._emit(self.streamer.finish())
        if not self.is_text:
            g = parse_grounding(self.streamer.text, self.task.skill, self.task.max_objects,
                                salvage=reason == FINISH_LENGTH)
            self.objects = g.objects
            if g.error:
                self.parse_error = g.error
                self.model.stats["grounding_parse_errors"] += 1
            self.model.stats["grounding_skipped_entries"] += g.skipped
