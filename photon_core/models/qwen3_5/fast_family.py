"""Qwen 3.5's runtime view (photon_core/fast/fast_family.py: FastFamily): the step program
(program.py), the prefix state of an encoded frame (the full-attention layers' k/v and the
DeltaNet layers' conv + fp32 recurrent states after the image prefix, with the M-RoPE position
offset; every task copies it into its row: copy-on-start), the chat prompts, and the text
skill protocol: each step's token feeds back, <|im_end|> / <|endoftext|> end it; detect /
point are greedy text answers parsed at the end as grounding JSON (grounding_json.py, with
the reference's salvage and error counting)."""
from __future__ import annotations

import torch

from ...engine import PrefixState
from ...fast.fast_family import ReferenceEncodeFamily, TextTask
from ...task import FINISH_LENGTH, Task
from ..grounding_json import parse_grounding, token_cap
from .program import step_spec
from .prompts import instruction
from .run import TOKENS_PER_OBJECT

TEXT_SKILLS = ("query", "caption")


class QwenFast(ReferenceEncodeFamily):
    """FastFamily of a Qwen35Model."""

    def __init__(self, model):
        super().__init__(model, step_spec(model.config))

    def _made_here(self, enc) -> bool:
        """The frame's HybridState, as a PrefixState in the program's state order."""
        return hasattr(enc, "state")

    def _build_prefix(self, enc) -> PrefixState:
        m, st = self.model, enc.state
        n = st.length
        kv = None
        if st.k:
            kv = torch.stack([torch.stack([st.k[i][:, :n], st.v[i][:, :n]])
                              for i in self.spec.program.kv_layers])[:, :, None]
        rec = tuple(st.conv[s.layer] if s.kind == "conv" else st.recurrent[s.layer]
                    for s in self.spec.program.row_states)
        return PrefixState(model_id=m.model_id, kv=kv, recurrent=rec, n_tokens=n,
                           position_offset=st.rope_pos - n, width=enc.width,
                           height=enc.height, encode_ms=enc.encode_ms)

    def prompt(self, task: Task, enc) -> list[int]:
        return self.model.prompts.task(task.skill, task.target, enc.prefix_text)

    def count_prompt_tokens(self, task: Task) -> int:
        prompts = self.model.prompts
        return len(prompts.encode(prompts.split(instruction(task.skill, task.target))[1]))

    def task_protocol(self, task: Task, ignore_eos: bool, room: int) -> TextTask:
        text = task.skill in TEXT_SKILLS
        budget = task.max_tokens if text else TOKENS_PER_OBJECT * task.max_objects + 16
        return TextTask(task, self.model.prompts.stop_ids, min(budget, room), ignore_eos,
                        sampled=text, streams=text,
                        parse=None if text else lambda s, reason: self._ground(task, s, reason),
                        until=None if text else token_cap(task.skill, task.max_objects,
                                                          self.model.prompts.decode))

    def _ground(self, task: Task, text: str, reason: str) -> list[dict]:
        g = parse_grounding(text, task.skill, task.max_objects, salvage=reason == FINISH_LENGTH)
        stats = self.model.stats
        if g.error:
            stats["grounding_parse_errors"] += 1
        stats["grounding_skipped_entries"] += g.skipped
        return g.objects

    def decode(self, ids: list[int]) -> str:
        return self.model.prompts.decode(ids)
