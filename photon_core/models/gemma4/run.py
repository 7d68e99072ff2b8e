"""One query/caption task on one encoded image, advanced one decode step at a time.

start: copy the image's prefix k/v (head + <boi> image tokens <eoi>) into a fresh cache
sized prefix + prompt tail + max_tokens, prefill the tail (question, end of turn, model turn),
pick the first token. Each step(): emit the current token (word-safe text deltas), feed it
(one decoder pass), pick the next. Stops at a stop token (eos, <turn|>) or max_tokens.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ...moondream.sampling import sample
from ...moondream.streaming import TextStreamer
from ...task import FINISH_LENGTH, FINISH_STOP, Task, TaskError, TaskResult, build_result
from . import text
from .kv_cache import KVCache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TaskRun:
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False, record_logits: bool = False):
        task.validate()
        model.check_skill(task.skill)
        self.model, self.enc, self.task, self.stream = model, enc, task, stream
        self.ignore_eos = ignore_eos           # test/benchmark hook: run to max_tokens
        self.logits: list[torch.Tensor] | None = [] if record_logits else None
        cfg = model.config.text
        tail = model.prompter.task_tail(task.skill, task.target)
        self.capacity = enc.length + len(tail) + task.max_tokens
        if self.capacity > model.max_context:
            raise TaskError(f"prompt is {len(tail)} tokens; with the {enc.length}-token image "
                            f"prefix and max_tokens {task.max_tokens} it does not fit the "
                            f"{model.max_context}-token context")
        self.generator = None
        if task.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(task.seed)
        self.finish_reason: str | None = None
        self.steps = 0
        self.streamer = TextStreamer(model.prompter.decode)
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}

        t0 = time.perf_counter()
        with torch.inference_mode():
            self.cache = KVCache(cfg, self.capacity, model.device, model.dtype)
            self.cache.load_prefix(enc.cache, enc.length)
            ids = torch.tensor(tail, device=model.device)
            h = model.forward_ids(ids, enc.length, self.cache)
            self.pos = enc.length + len(tail)
            self.next_token = self._pick(h[-1])
        self._check_end()
        _sync(model.device)
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        return self.streamer.text + self.streamer.pending()

    def step(self) -> bool:
        """One decoder forward pass. Returns False once the task has finished."""
        if self.finished:
            return False
        t0 = time.perf_counter()
        self.steps += 1
        token = self.next_token
        self._emit(self.streamer.push(token))
        if self.steps >= self.task.max_tokens:        # that token was the last one allowed
            self._finish(FINISH_LENGTH)
        else:
            with torch.inference_mode():
                h = self.model.forward_ids(torch.tensor([token], device=self.model.device),
                                           self.pos, self.cache)
                self.pos += 1
                self.next_token = self._pick(h[-1])
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
        return build_result(self.task, [], self.streamer.text, self.finish_reason, self.steps,
                            self.timings)

    # -- mechanics ----------------------------------------------------------------------
    def _pick(self, hidden: torch.Tensor) -> int:
        logits = text.logits(self.model.weights, self.model.config.text, hidden)
        if self.logits is not None:
            self.logits.append(logits.float().cpu())
        return sample(logits, self.task.temperature, self.task.top_p, self.generator)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._emit(self.streamer.finish())

    def _emit(self, delta: str) -> None:
        if delta and self.stream is not None:
            self.stream(delta)

    def _check_end(self) -> None:
        if self.next_token in self.model.prompter.stop_ids and not self.ignore_eos:
            self._finish(FINISH_STOP)
        elif self.pos >= self.capacity:
            self._finish(FINISH_LENGTH)
