"""Gemma 4's runtime view (photon_core/fast/fast_family.py: FastFamily): the step program
(program.py: per-layer attention over rings and full-length layers of their own head sizes,
per-layer embeddings, the scaled-token feedback), the prefix state of an encoded image (the
reference's vision tower + image-prefix prefill: k/v of every layer that computes k/v, one
tensor per layer; each task copies it into its row, a ring layer keeping its last window),
the chat prompt tail, and the text skill protocol: each step's token feeds back, eos /
<turn|> end it (query, caption; detect / point are refused with the family's message)."""
from __future__ import annotations

import torch

from ...engine import PrefixState
from ...fast.fast_family import ReferenceEncodeFamily, TextTask
from ...task import Task
from .program import EMBED, EMBED_PER_LAYER


class Gemma4Fast(ReferenceEncodeFamily):
    """FastFamily of a Gemma4Model."""

    def __init__(self, model):
        super().__init__(model, model.step_spec())
        table = model.weights.get(EMBED_PER_LAYER)
        if table is not None and table.device != model.weights[EMBED].device:
            # the decode step's feedback gathers the next token's rows on the device, inside
            # its CUDA graphs: a table in host memory (load_model(ple_on_cpu=True)) is the
            # reference engine's only
            raise ValueError("the fast path keeps Gemma 4's per-layer embedding table on the "
                             "model's device: load without ple_on_cpu, or use engine "
                             "'reference'")

    def _made_here(self, enc) -> bool:
        """An encoded image's k/v (one [2, 1, Hkv, T, D] per layer of the program's state,
        in its order) in this model's dtype."""
        return hasattr(enc, "cache") and enc.cache.k[0].dtype == self.model.dtype

    def _build_prefix(self, enc) -> PrefixState:
        n, c = enc.length, enc.cache
        kv = tuple(torch.stack([c.k[s.layer][:, :n], c.v[s.layer][:, :n]])[:, None]
                   for s in self.spec.program.attention_states)
        return PrefixState(model_id=self.model.model_id, kv=kv, n_tokens=n, width=enc.width,
                           height=enc.height, encode_ms=enc.encode_ms)

    def prompt(self, task: Task, enc) -> list[int]:
        self.model.check_skill(task.skill)
        return self.model.prompter.task_tail(task.skill, task.target)

    def count_prompt_tokens(self, task: Task) -> int:
        return self.model.count_prompt_tokens(task)

    def task_protocol(self, task: Task, ignore_eos: bool, room: int) -> TextTask:
        self.model.check_skill(task.skill)
        return TextTask(task, self.model.prompter.stop_ids, min(task.max_tokens, room),
                        ignore_eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.prompter.decode(ids)
