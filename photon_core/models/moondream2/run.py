"""One task on one encoded image, advanced one decode step at a time.

start: copy the image's 730-token k/v prefix into a fresh preallocated cache, prefill the
prompt after it (causal), pick the first token. Then each step() runs exactly one decoder
forward pass:

query / caption: emit the current token (streamed as word-safe text deltas), feed it, pick
  the next one (the answer marker is never picked again). Stops at eos or max_tokens.
detect: per object three steps, all greedy:
  x = coord head(hidden) -> feed enc(x);  y = coord head(hidden) -> feed enc(y);
  (w, h) = size head(hidden) -> feed enc(w, h) -> the logits say eos (stop) or "another".
  Box = (x -+ w/2, y -+ h/2), normalized to the image. point: the same without the size step.
  The object that reaches max_objects ends the task ("length") without its feed: the public
  reference's loop runs that forward and reads nothing of it (the same objects).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...task import FINISH_LENGTH, FINISH_STOP, Task, TaskError
from ..task_run_base import TaskRunBase, _sync  # noqa: F401  (_sync: model.py's)
from . import region, text
from . import skill_protocol as sp
from .kv_cache import KVCache
from .sampling import sample


class TaskRun(TaskRunBase):
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        cfg, w = model.config, model.weights
        prompt = model.tokenizer.prompt(task.skill, task.target)
        prefix = enc.kv.shape[4]
        if prefix + len(prompt) + 1 > cfg.text.max_context:
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {prefix}-token image "
                            f"prefix it does not fit the {cfg.text.max_context}-token context")
        super().__init__(model, enc, task, stream, ignore_eos, sp.is_text(task.skill),
                         model.tokenizer.decode, task.max_tokens)
        self.capacity = min(cfg.text.max_context, prefix + len(prompt) + sp.step_budget(task))
        self.region = sp.RegionCollector(task.skill)
        self.objects = self.region.objects
        self.phase = sp.first_phase(task.skill)

        def prefill() -> int:
            # storage for the whole context: attention always spans max_context positions
            # (text.py), so decode steps read a view instead of a padded copy
            self.cache = KVCache(cfg.text.n_layers, cfg.text.n_kv_heads, cfg.text.max_context,
                                 cfg.text.head_dim, w.device, w.dtype)
            self.cache.load_prefix(enc.kv)
            ids = torch.tensor([prompt], device=w.device)
            hidden = text.decoder(w, cfg.text, text.embed(w, ids), prefix, self.cache,
                                  model.prefix_len)
            self.hidden = hidden[:, -1:]
            self.pos = prefix + len(prompt)
            return self._pick(text.lm_head(w, self.hidden[0, 0]), first=True)
        self._prefill_timed(prefill)

    # -- mechanics ----------------------------------------------------------------------
    def _advance(self) -> None:
        with torch.inference_mode():
            if self.is_text:
                super()._advance()
            else:
                self._region_step()

    def _pick(self, logits: torch.Tensor, first: bool = False) -> int:
        tk = self.model.config.tokenizer
        if not self.is_text:
            return int(logits.argmax())
        if not first:
            logits = logits.clone()
            logits[tk.answer_id] = float("-inf")
        return sample(logits, self.task.temperature, self.task.top_p, self.generator)

    def _forward(self, emb: torch.Tensor) -> None:
        m = self.model
        self.hidden = text.decoder(m.weights, m.config.text, emb, self.pos, self.cache,
                                   m.prefix_len)
        self.pos += 1

    def _check_end(self) -> None:
        """After a token was picked: eos ends the task; so do exhausted budgets."""
        if self.next_token == self.model.config.tokenizer.eos_id and not self.ignore_eos:
            self._finish(FINISH_STOP)
        elif not self.is_text and len(self.objects) >= self.task.max_objects:
            self._finish(FINISH_LENGTH)
        elif self.pos >= self.capacity:
            self._finish(FINISH_LENGTH)

    def _feed(self, token: int) -> int:
        w = self.model.weights
        self._forward(text.embed(w, torch.tensor([[token]], device=w.device)))
        return self._pick(text.lm_head(w, self.hidden[0, 0]))

    def _region_step(self) -> None:
        """One step of an object's phase (skill_protocol.py): decode the phase's value with its
        head, collect it, feed it back; at the start of the next object the lm head says
        whether there is one (eos) or not."""
        w, ph = self.model.weights, self.phase
        if ph == sp.PHASE_SIZE:
            value = region.decode_size(w, self.hidden)
            emb = region.encode_size(w, *value)
        else:
            value = region.decode_coordinate(w, self.hidden)
            emb = region.encode_coordinate(w, value)
        self.region.take(ph, value)
        if sp.ends_object(ph, self.region.kind) and len(self.objects) >= self.task.max_objects:
            # the last object allowed: nothing reads a forward after it (as the last token of
            # a text task is not fed) - the task ends at its budget, whatever would follow
            self._finish(FINISH_LENGTH)
            return
        self._forward(emb)
        self.phase = sp.next_phase(ph, self.region.kind)
        if "lm" in sp.HEADS[self.phase]:
            self.next_token = self._pick(text.lm_head(w, self.hidden[0, 0]))
            self._check_end()
