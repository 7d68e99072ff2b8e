"""Text <-> token ids (the `tokenizers` library reading a tokenizer.json) and prompt building.

Prompts follow the reference's templates from the config:
  caption:      templates["caption"][length]
  query:        prefix + encode(question) + suffix + suffix   (the reference, since its
                June 2025 tokenizer, sends the answer marker twice when not reasoning)
  detect/point: prefix + encode(" " + object) + suffix
"""
from __future__ import annotations

from pathlib import Path

from .config import TokenizerConfig


class Tokenizer:
    def __init__(self, path_or_tokenizer, cfg: TokenizerConfig):
        from tokenizers import Tokenizer as HFTokenizer

        if isinstance(path_or_tokenizer, (str, Path)):
            self.tok = HFTokenizer.from_file(str(path_or_tokenizer))
        else:
            self.tok = path_or_tokenizer
        self.cfg = cfg

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def prompt(self, skill: str, target: str) -> list[int]:
        tpl = self.cfg.templates.get(skill)
        if tpl is None:
            raise ValueError(f"this model's config has no {skill!r} template")
        if skill == "caption":
            if target not in tpl:
                raise ValueError(f"this model has no caption length {target!r}")
            return list(tpl[target])
        if skill == "query":
            return tpl["prefix"] + self.encode(target) + tpl["suffix"] + tpl["suffix"]
        return tpl["prefix"] + self.encode(" " + target) + tpl["suffix"]
