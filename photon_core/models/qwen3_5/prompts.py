"""Tokenizer (tokenizers library over tokenizer.json) and the chat-template prompts of each skill.

Every skill is one user turn: the image, then the instruction text, then the generation prompt
(thinking off). The rendered text is split right after <|vision_end|>: the part before is the
image prefix (identical for every task, so its decoder state is computed once per frame), the
part after is the task's own prompt. The single <|image_pad|> of the template is expanded to
the image's number of merged tokens. detect/point ask for the model's grounding JSON
(bbox_2d / point_2d on a 0..1000 grid); see photon_core/models/grounding_json.py.
"""
from __future__ import annotations

from pathlib import Path

CAPTIONS = {"short": "Describe this image in one short sentence.",
            "normal": "Describe this image.",
            "long": "Describe this image in detail."}


def instruction(skill: str, target: str) -> str:
    if skill == "query":
        return target
    if skill == "caption":
        return CAPTIONS[target]
    if skill == "detect":
        return (f"Locate every {target} in the image and output the bounding boxes in JSON "
                f'format: [{{"bbox_2d": [x1, y1, x2, y2], "label": "{target}"}}].')
    if skill == "point":
        return (f"Point to every {target} in the image and output the points in JSON "
                f'format: [{{"point_2d": [x, y], "label": "{target}"}}].')
    raise ValueError(f"unknown skill {skill!r}")


class PromptError(ValueError):
    pass


class ChatPrompts:
    def __init__(self, tokenizer_path: Path | str, template: str | None, image_token_id: int,
                 vision_end_token_id: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))
        if not template:
            raise PromptError("the checkpoint has no chat template (chat_template.jinja or "
                              "tokenizer_config.json 'chat_template')")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message):
            raise PromptError(f"chat template: {message}")
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template does not compile: {e}") from None
        self.image_token_id = image_token_id
        self.vision_end = self.tok.id_to_token(vision_end_token_id)
        self.image_pad = self.tok.id_to_token(image_token_id)
        if self.vision_end is None or self.image_pad is None:
            raise PromptError("tokenizer.json lacks the vision_end / image_pad tokens of config.json")
        self.stop_ids = {i for i in (self.tok.token_to_id("<|im_end|>"),
                                     self.tok.token_to_id("<|endoftext|>")) if i is not None}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def render(self, text: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    enable_thinking=False)

    def split(self, text: str) -> tuple[str, str]:
        """-> (image prefix text, task text) of the rendered prompt."""
        full = self.render(text)
        cut = full.find(self.vision_end)
        if cut < 0 or full.count(self.image_pad) != 1:
            raise PromptError("the chat template does not render the image as one "
                              f"{self.image_pad} followed by {self.vision_end}")
        cut += len(self.vision_end)
        return full[:cut], full[cut:]

    def image_prefix(self, n_image_tokens: int) -> tuple[str, list[int]]:
        """-> (prefix text, its ids with the image pad expanded)."""
        text, _ = self.split("x")
        ids: list[int] = []
        for i in self.encode(text):
            ids.extend([i] * n_image_tokens if i == self.image_token_id else [i])
        return text, ids

    def task(self, skill: str, target: str, prefix_text: str) -> list[int]:
        pre, rest = self.split(instruction(skill, target))
        if pre != prefix_text:
            raise PromptError("this task's rendered prompt does not start with the image prefix")
        return self.encode(rest)
