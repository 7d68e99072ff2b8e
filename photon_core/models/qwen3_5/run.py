"""One task on one encoded frame, advanced one decode step at a time (Qwen 3.5 reference).

start: copy the frame's prefix state (attention k/v + DeltaNet conv/recurrent states) into a
private state with room for prompt + budget, prefill the task's prompt after it, pick the first
token. Each step() emits the current token (query/caption: streamed as word-safe deltas),
feeds it (one decoder forward) and picks the next. Stops at <|im_end|> / <|endoftext|>, or at
the budget: max_tokens for query/caption; for detect/point enough tokens for max_objects
JSON entries, and at the max_objects-th complete entry (grounding_json.token_cap: finish
reason "length"). detect/point are greedy; their text is parsed by grounding_json at the end
(a malformed answer: empty result, `parse_error` set and counted in model.stats).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..grounding_json import parse_grounding, token_cap
from ..task_run_base import TaskRunBase, _sync  # noqa: F401  (_sync: model.py's)
from ._shared import FINISH_LENGTH, FINISH_STOP, Task, TaskError, sample
from . import decoder

TOKENS_PER_OBJECT = 40   # a real-tokenizer JSON box entry is ~30 tokens (digits one by one)


class TaskRun(TaskRunBase):
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        is_text = task.skill in ("query", "caption")
        prompt = model.prompts.task(task.skill, task.target, enc.prefix_text)
        budget = task.max_tokens if is_text else TOKENS_PER_OBJECT * task.max_objects + 16
        prefix = enc.state.length
        limit = model.max_context
        if prefix + len(prompt) + 1 > limit:
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {prefix}-token image "
                            f"prefix it does not fit the {limit}-token context")
        super().__init__(model, enc, task, stream, ignore_eos, is_text, model.prompts.decode,
                         min(budget, limit - prefix - len(prompt)))
        self.parse_error: str | None = None
        if not is_text:           # the answer ends at its max_objects-th JSON entry
            self.until = token_cap(task.skill, task.max_objects, model.prompts.decode)

        def prefill() -> int:
            self.state = enc.state.copy(prefix + len(prompt) + self.budget + 1)
            return self._forward(prompt)
        self._prefill_timed(prefill)

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

    def _feed(self, token: int) -> int:
        return self._forward([token])

    def _check_end(self) -> None:
        if self.next_token in self.model.prompts.stop_ids and not self.ignore_eos:
            self._finish(FINISH_STOP)

    def _finish(self, reason: str) -> None:
        super()._finish(reason)
        if not self.is_text:
            g = parse_grounding(self.streamer.text, self.task.skill, self.task.max_objects,
                                salvage=reason == FINISH_LENGTH)
            self.objects = g.objects
            if g.error:
                self.parse_error = g.error
                self.model.stats["grounding_parse_errors"] += 1
            self.model.stats["grounding_skipped_entries"] += g.skipped
