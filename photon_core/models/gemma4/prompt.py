"""Tokenizer and prompts of a Gemma 4 checkpoint: tokenizer.json (tokenizers library) and the
checkpoint's chat template (chat_template.jinja, else tokenizer_config.json "chat_template"),
rendered with jinja2 in a sandbox.

A prompt is one user turn [image, text] with the generation prompt. The template writes one
image placeholder token; the ids before it are the `head` (the same for every question: the
encoded image's prefix is head + <boi> + N image tokens + <eoi>), the ids after it the task's
`tail` (question, end of turn, start of the model's turn).
"""
from __future__ import annotations

import json
from pathlib import Path

from ...task import TaskError

CAPTION_PROMPTS = {"short": "Describe this image in one short sentence.",
                   "normal": "Describe this image.",
                   "long": "Describe this image in detail."}


class PromptError(ValueError):
    pass


def read_chat_template(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        t = json.loads(tc.read_text()).get("chat_template")
        if isinstance(t, list):                       # [{"name": "default", "template": ...}]
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        if isinstance(t, str):
            return t
    raise PromptError(f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json)")


class Prompter:
    def __init__(self, tokenizer_json: Path, chat_template: str, image_token_id: int,
                 bos_id: int, eos_ids: tuple[int, ...]):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self.template = env.from_string(chat_template)
        self.image_token_id = image_token_id
        self.bos = self.tok.id_to_token(bos_id) or "<bos>"
        stops = set(eos_ids)
        for name in ("<turn|>", "<eos>", "<end_of_turn>"):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                stops.add(tid)
        self.stop_ids = frozenset(stops)
        self.head = self.split("x")[0]

    @staticmethod
    def _raise(msg):
        raise PromptError(f"chat template: {msg}")

    def render(self, text: str) -> str:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return self.template.render(messages=msgs, add_generation_prompt=True,
                                    bos_token=self.bos, eos_token="<eos>")

    def split(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tok.encode(self.render(text), add_special_tokens=False).ids
        hits = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(hits) != 1:
            raise PromptError(f"the chat template wrote {len(hits)} image tokens "
                              f"(id {self.image_token_id}) for one image")
        return ids[:hits[0]], ids[hits[0] + 1:]

    def task_tail(self, skill: str, target: str) -> list[int]:
        if skill == "query":
            text = target
        elif skill == "caption":
            text = CAPTION_PROMPTS[target]
        else:
            raise TaskError(f"Gemma 4 has no prompt for skill {skill!r}")
        head, tail = self.split(text)
        if head != self.head:
            raise PromptError("the chat template's text before the image depends on the question")
        return tail

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
