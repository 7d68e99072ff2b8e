"""Tiny random Gemma 4 checkpoints in the real HF layout, for tests and CPU smoke runs:
config.json (model_type gemma4, transformers 5 spelling), two safetensors shards with
model.safetensors.index.json (tied embeddings: no lm_head tensor), tokenizer.json (a small
byte-level BPE with Gemma 4's special tokens), chat_template.jinja (Gemma 4's turn markers),
tokenizer_config.json and generation_config.json.

The default tiny model keeps every mechanism of E2B/E4B at toy size: 6 layers, sliding
window 8 (shorter than an image prompt), 2 KV-shared layers (one sliding, one global),
wider global heads with proportional RoPE, per-layer embeddings, double-wide MLPs on the
shared layers, logit soft-capping; vision: 4-pixel patches, 3x3 pooling. Weights are random
with non-trivial norms, layer scalars and position table (so a missed one shows).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..test_tokenizer import train_bpe_tokenizer
from .config import parse_config
from .weights import expected_shapes

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|image>",
                  "<image|>", "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>",
                  "<|channel>", "<channel|>", "<|tool_response>"]
TEST_VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")

_CORPUS = """
A person is standing next to a red car on a busy street. Two dogs play in the park.
The kitchen has a white table, four chairs and a window. What color is the cup? It is blue.
How many people are in the picture? There are three people. A cat sleeps on the sofa.
Describe this image in detail. Describe this image in one short sentence. Describe this image.
A robot arm picks up a box from the conveyor belt in a warehouse. user model
The sky is clear and the sun is shining over the mountains. Is there a bottle? Yes.
"""


def build_test_tokenizer(vocab_size: int = TEST_VOCAB_SIZE):
    return train_bpe_tokenizer(SPECIAL_TOKENS, _CORPUS, vocab_size)


def tiny_config_dict(vocab_size: int, text: dict | None = None, vision: dict | None = None) -> dict:
    ids = {name: SPECIAL_TOKENS.index(name) for name in SPECIAL_TOKENS}
    t = {
        "model_type": "gemma4_text", "vocab_size": vocab_size, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "sliding_attention", "full_attention"],
        "per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 32}},
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 8, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "attention_k_eq_v": False,
        "enable_moe_block": False, "use_bidirectional_attention": None, "attention_bias": False,
        "attention_dropout": 0.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"]], "initializer_range": 0.02,
        "use_cache": True,
    }
    v = {
        "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh", "patch_size": 4, "pooling_kernel_size": 3,
        "position_embedding_size": 64, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}, "standardize": False,
        "use_clipped_linears": False, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "max_position_embeddings": 131072,
    }
    t.update(text or {})
    v.update(vision or {})
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": t, "vision_config": v, "audio_config": None,
            "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"],
            "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
            "boa_token_id": ids["<|audio>"], "eoa_token_index": ids["<audio|>"],
            "audio_token_id": ids["<|audio|>"], "tie_word_embeddings": True,
            "initializer_range": 0.02, "dtype": "float32", "transformers_version": "5.24.0"}


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("layer_scalar"):
            t = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith(("norm.weight", "layernorm.weight", "std_scale")):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("position_embedding_table") or name.endswith("std_bias"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith(("input_min", "output_min")):
            t = torch.tensor(-4.0)
        elif name.endswith(("input_max", "output_max")):
            t = torch.tensor(4.0)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = t.float().contiguous()
    return out


def _checkpoint_name(key: str) -> str:
    return key if key == "lm_head.weight" else "model." + key


def make_test_model(out_dir, seed: int = 0, text: dict | None = None,
                    vision: dict | None = None, shards: int = 2) -> Path:
    """Write a tiny random Gemma 4 checkpoint to out_dir; returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer()
    cfg_dict = tiny_config_dict(tok.get_vocab_size(), text, vision)
    cfg = parse_config(cfg_dict)
    tensors = {_checkpoint_name(k): t for k, t in random_tensors(expected_shapes(cfg), seed).items()}
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
        "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
        "model_specific_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>",
                                          "image_token": "<|image|>"}}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": cfg.text.bos_id, "eos_token_id": list(cfg.text.eos_ids),
        "pad_token_id": cfg.text.pad_id}, indent=2))
    return out


if __name__ == "__main__":      # python -m photon_core.models.gemma4.test_model DIR [SEED]
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m photon_core.models.gemma4.test_model DIR [SEED]")
    print(json.dumps({"written": str(make_test_model(sys.argv[1], int(sys.argv[2])
                                                     if len(sys.argv) == 3 else 0))}))
