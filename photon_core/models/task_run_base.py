"""TaskRunBase: the bookkeeping every family's reference task run shares (one task on one
encoded image, advanced one decoder forward pass at a time).

A family's TaskRun checks the task and its prompt against the context, calls
TaskRunBase.__init__ (run state, sampling generator, text streamer, timings), then
_prefill_timed(fn) with fn prefilling the prompt after the image prefix and returning the
first token. It defines _feed(token) -> next token (one decoder forward over a text token) and
_check_end() (stop token / exhausted room after a token was picked); a family with non-text
steps (Moondream's region heads) overrides _advance().

Text steps: emit the current token (word-safe deltas, query/caption only), end at the budget
(`budget`: tokens allowed) or where `until(token)` says the task has what it asked for (Qwen
3.5's grounding: its max_objects-th JSON entry, grounding_json.token_cap), else feed it and
pick the next one.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..streaming import TextStreamer
from ..task import FINISH_LENGTH, Task, TaskResult, build_result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TaskRunBase:
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None,
                 ignore_eos: bool, is_text: bool, decode: Callable[[list[int]], str],
                 budget: int):
        self.model, self.enc, self.task, self.stream = model, enc, task, stream
        self.ignore_eos = ignore_eos   # test/benchmark hook: run to the budget
        self.is_text = is_text
        self.budget = budget
        self.until: Callable[[int], bool] | None = None     # a family's early end (length)
        self.generator = None
        if task.seed is not None and is_text:
            self.generator = torch.Generator(device=model.device).manual_seed(task.seed)
        self.finish_reason: str | None = None
        self.steps = 0
        self.tokens: list[int] = []
        self.objects: list[dict] = []
        self.streamer = TextStreamer(decode)
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}

    def _prefill_timed(self, prefill: Callable[[], int]) -> None:
        """Run prefill() (-> the first token) and check the end, timed as prefill_ms."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.next_token = prefill()
        self._check_end()
        _sync(self.model.device)
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3

    # -- public ---------------------------------------------------------------------------
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
        self._advance()
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
    def _advance(self) -> None:
        """One text step: emit the current token, then feed it unless it was the last."""
        token = self.next_token
        self.tokens.append(token)
        self._emit(self.streamer.push(token))
        if self.steps >= self.budget or (self.until is not None and self.until(token)):
            self._finish(FINISH_LENGTH)     # the last token allowed / the last one needed
            return
        with torch.inference_mode():
            self.next_token = self._feed(token)
        self._check_end()

    def _feed(self, token: int) -> int:
        raise NotImplementedError

    def _check_end(self) -> None:
        raise NotImplementedError

    def _emit(self, delta: str) -> None:
        if delta and self.stream is not None and self.is_text:
            self.stream(delta)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._emit(self.streamer.finish())
