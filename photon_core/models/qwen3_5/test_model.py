"""Tiny random Qwen 3.5 checkpoints in the exact Hugging Face layout (tests, smoke benchmarks).

Built with transformers' own Qwen3_5Config / Qwen3_5ForConditionalGeneration and written with
save_pretrained, so names, shapes and config.json are those transformers reads and writes
(only this writer needs transformers; the loader does not). Next to them: a small byte-level
BPE tokenizer.json with Qwen's special tokens, a ChatML chat template (chat_template.jinja)
and a preprocessor_config.json with a small pixel budget. Norm weights get random offsets
(zero-init would hide a wrong 1 + w), and weights are larger than transformers' default init
so that the greedy tokens of a random model are well separated.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..test_tokenizer import train_bpe_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
TEST_VOCAB_SIZE = 400

_CORPUS = """
A person is standing next to a red car on a busy street. Two dogs play in the park.
The kitchen has a white table, four chairs and a window. What color is the cup? It is blue.
user assistant system Describe this image. Detect every person. Point to the cup.
Answer in JSON: [{"bbox_2d": [10, 20, 300, 400], "label": "person"}] {"point_2d": [5, 6]}
0 1 2 3 4 5 6 7 8 9 10 100 250 500 999 1000 , : [ ] { } " bbox_2d point_2d label
"""

# A ChatML template written for the tests (the real checkpoints bring their own): system /
# user / assistant turns, images as <|vision_start|><|image_pad|><|vision_end|>, and the
# generation prompt with an empty think block unless enable_thinking is true.
CHAT_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}
{{- message['content'] }}
{%- else %}
{%- for part in message['content'] %}
{%- if part['type'] == 'image' %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part['type'] == 'text' %}
{{- part['text'] }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if not (enable_thinking | default(false)) %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def build_test_tokenizer(vocab_size: int = TEST_VOCAB_SIZE):
    return train_bpe_tokenizer(SPECIAL_TOKENS, _CORPUS, vocab_size)


def tiny_hf_config(tok, **kw):
    """transformers' Qwen3_5Config of the tiny test model (kw overrides text_config fields)."""
    from transformers import Qwen3_5Config

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                initializer_range=0.08, eos_token_id=ids["<|im_end|>"],
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                     mrope_interleaved=True))
    text.update(kw)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=64, initializer_range=0.08)
    return Qwen3_5Config(text_config=text, vision_config=vision,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}


def make_test_model(out_dir, seed: int = 0, shards: int = 1, **text_kw) -> Path:
    """Write a tiny random checkpoint; shards > 1 writes model.safetensors.index.json + shards."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer()
    cfg = tiny_hf_config(tok, **text_kw)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    size = sum(p.numel() * 4 for p in model.parameters())
    kw = {"max_shard_size": max(1, size // shards // 1000 + 1) * 1000} if shards > 1 else {}
    model.save_pretrained(str(out), safe_serialization=True, **kw)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "Qwen2Tokenizer"}, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return out
