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
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ...task import FINISH_LENGTH, FINISH_STOP, Task, TaskError, TaskResult, build_result
from . import region, text
from . import skill_protocol as sp
from .kv_cache import KVCache
from .sampling import sample
from .streaming import TextStreamer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TaskRun:
    def __init__(self, model, enc, task: Task, stream: Callable[[str], None] | None = None,
                 ignore_eos: bool = False):
        task.validate()
        self.ignore_eos = ignore_eos   # test/benchmark hook: run to max_tokens/max_objects
        self.model, self.enc, self.task, self.stream = model, enc, task, stream
        cfg, w = model.config, model.weights
        self.is_text = sp.is_text(task.skill)
        prompt = model.tokenizer.prompt(task.skill, task.target)
        prefix = enc.kv.shape[4]
        if prefix + len(prompt) + 1 > cfg.text.max_context:
            raise TaskError(f"prompt is {len(prompt)} tokens; with the {prefix}-token image "
                            f"prefix it does not fit the {cfg.text.max_context}-token context")
        self.capacity = min(cfg.text.max_context, prefix + len(prompt) + sp.step_budget(task))
        self.generator = None
        if task.seed is not None and self.is_text:
            self.generator = torch.Generator(device=w.device).manual_seed(task.seed)

        self.finish_reason: str | None = None
        self.steps = 0
        self.region = sp.RegionCollector(task.skill)
        self.objects = self.region.objects
        self.phase = sp.first_phase(task.skill)
        self.streamer = TextStreamer(model.tokenizer.decode)
        self.timings = {"encode_ms": enc.encode_ms, "prefill_ms": 0.0, "decode_ms": 0.0}

        t0 = time.perf_counter()
        with torch.inference_mode():
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
            self.next_token = self._pick(text.lm_head(w, self.hidden[0, 0]), first=True)
        self._check_end()
        _sync(w.device)
        self.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3

    # -- public -------------------------------------------------------------------------
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
        with torch.inference_mode():
            if self.is_text:
                self._text_step()
            else:
                self._region_step()
        _sync(self.model.weights.device)
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

    # -- mechanics ----------------------------------------------------------------------
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

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.is_text:
            self._emit(self.streamer.finish())

    def _emit(self, delta: str) -> None:
        if delta and self.stream is not None:
            self.stream(delta)

    def _check_end(self) -> None:
        """After a token was picked: eos ends the task; so do exhausted budgets."""
        if self.next_token == self.model.config.tokenizer.eos_id and not self.ignore_eos:
            self._finish(FINISH_STOP)
        elif not self.is_text and len(self.objects) >= self.task.max_objects:
            self._finish(FINISH_LENGTH)
        elif self.pos >= self.capacity:
            self._finish(FINISH_LENGTH)

    def _text_step(self) -> None:
        w = self.model.weights
        token = self.next_token
        self._emit(self.streamer.push(token))
        if self.steps >= self.task.max_tokens:   # this token was the last one allowed
            self._finish(FINISH_LENGTH)
            return
        self._forward(text.embed(w, torch.tensor([[token]], device=w.device)))
        self.next_token = self._pick(text.lm_head(w, self.hidden[0, 0]))
        self._check_end()

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
        self._forward(emb)
        self.phase = sp.next_phase(ph, self.region.kind)
        if "lm" in sp.HEADS[self.phase]:
            self.next_token = self._pick(text.lm_head(w, self.hidden[0, 0]))
            self._check_end()
