"""One query/caption task on one encoded image, advanced one decode step at a time.

start: copy the image's prefix k/v (head + <boi> image tokens <eoi>) into a fresh cache
sized prefix + prompt tail + max_tokens, prefill the tail (question, end of turn, model turn),
pick the first token. Each step(): emit the current token (word-safe text deltas), feed it
(one decoder pass), pick the next. Stops at a stop token (eos, <turn|>) or max_tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...moondream.sampling import sample
from ...task import FINISH_LENGTH, FINISH_STOP, Task, TaskError
from ..task_run_base import TaskRunBase, _sync  # noqa: F401  (_sync: model.py's)
from . import text
from .kv_cache import KVCache


class TaskRun(TaskRunBase):
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False, record_logits: bool = False):
        task.validate()
        model.check_skill(task.skill)
        self.logits: list[torch.Tensor] | None = [] if record_logits else None
        tail = model.prompter.task_tail(task.skill, task.target)
        self.capacity = enc.length + len(tail) + task.max_tokens
        if self.capacity > model.max_context:
            raise TaskError(f"prompt is {len(tail)} tokens; with the {enc.length}-token image "
                            f"prefix and max_tokens {task.max_tokens} it does not fit the "
                            f"{model.max_context}-token context")
        super().__init__(model, enc, task, stream, ignore_eos, True, model.prompter.decode,
                         task.max_tokens)

        def prefill() -> int:
            self.cache = KVCache(model.config.text, self.capacity, model.device, model.dtype)
            self.cache.load_prefix(enc.cache, enc.length)
            ids = torch.tensor(tail, device=model.device)
            h = model.forward_ids(ids, enc.length, self.cache)
            self.pos = enc.length + len(tail)
            return self._pick(h[-1])
        self._prefill_timed(prefill)

    # -- mechanics ----------------------------------------------------------------------
    def _pick(self, hidden: torch.Tensor) -> int:
        logits = text.logits(self.model.weights, self.model.config.text, hidden)
        if self.logits is not None:
            self.logits.append(logits.float().cpu())
        return sample(logits, self.task.temperature, self.task.top_p, self.generator)

    def _feed(self, token: int) -> int:
        h = self.model.forward_ids(torch.tensor([token], device=self.model.device), self.pos,
                                   self.cache)
        self.pos += 1
        return self._pick(h[-1])

    def _check_end(self) -> None:
        if self.next_token in self.model.prompter.stop_ids and not self.ignore_eos:
            self._finish(FINISH_STOP)
        elif self.pos >= self.capacity:
            self._finish(FINISH_LENGTH)
