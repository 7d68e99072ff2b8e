"""Tiny random Moondream 2 checkpoints for tests: same tensor names as the real layout,
small dimensions, a small byte-level BPE tokenizer.json and a config.json in the reference
dict form (so the reference implementation can load the same files).

The default tiny config keeps what the reference hard-codes: 378-pixel crops of 14-pixel
patches (729 image tokens), 27 vision layers (it pools to enc_n_layers x enc_n_layers),
64-dim text heads (its rotary code assumes 32 rotated dims) and a 2048-token context.
`fast=True` gives a smaller, faster (not reference-loadable) vision tower for unit tests.
`real_shapes=True` gives Moondream 2's real shapes (MoondreamConfig() defaults: 1.9 B
parameters, 3.85 GB in bf16) with random weights, for benchmarks and soaks on a GPU where
the real weights cannot be downloaded; generated on `device` (a GPU takes seconds). Its
tokenizer is still the small test one (generated ids it does not know decode to nothing).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..test_tokenizer import train_bpe_tokenizer
from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|md_1|>", "<|md_2|>", "<|answer|>", "<|thinking|>",
                  "<|coord|>", "<|size|>", "<|ground_start|>", "<|md_8|>", "<|ground_end|>"]
TEST_VOCAB_SIZE = 512

_CORPUS = """
A person is standing next to a red car on a busy street. Two dogs play in the park.
The kitchen has a white table, four chairs and a window. What color is the cup? It is blue.
How many people are in the picture? There are three people. A cat sleeps on the sofa.
Describe the image. A robot arm picks up a box from the conveyor belt in a warehouse.
The sky is clear and the sun is shining over the mountains. Is there a bottle? Yes.
caption short normal long query detect point person car dog cat cup bottle box face hand
"""


def build_test_tokenizer(vocab_size: int = TEST_VOCAB_SIZE):
    """A byte-level BPE tokenizer (tokenizers library) with Moondream's special ids 0..9."""
    return train_bpe_tokenizer(SPECIAL_TOKENS, _CORPUS, vocab_size)


def test_templates(tok) -> dict:
    """Prompt templates in the reference's shape, made of this tokenizer's ids."""
    def ids(s):
        return tok.encode(s, add_special_tokens=False).ids
    return {
        "caption": {n: [1] + ids("caption") + [2] + ids(" " + n) + [3]
                    for n in ("short", "normal", "long")},
        "query": {"prefix": [1] + ids("query") + [2], "suffix": [3]},
        "detect": {"prefix": [1] + ids("detect") + [2], "suffix": [3]},
        "point": {"prefix": [1] + ids("point") + [2], "suffix": [3]},
    }


def tiny_config(tok=None, fast: bool = False) -> MoondreamConfig:
    tok = tok or build_test_tokenizer()
    dim = 128
    if fast:
        vision = VisionConfig(enc_dim=32, enc_n_layers=2, enc_ff_dim=64, enc_n_heads=2,
                              crop_size=84, overlap_margin=1, max_crops=4,
                              proj_inner_dim=64, proj_out_dim=dim)
        text = TextConfig(dim=dim, ff_dim=256, n_layers=2, vocab_size=tok.get_vocab_size(),
                          max_context=256, n_heads=2, n_kv_heads=2, prefix_attn=37)
    else:
        vision = VisionConfig(enc_dim=32, enc_n_layers=27, enc_ff_dim=64, enc_n_heads=2,
                              proj_inner_dim=64, proj_out_dim=dim)
        text = TextConfig(dim=dim, ff_dim=256, n_layers=2, vocab_size=tok.get_vocab_size(),
                          n_heads=2, n_kv_heads=2)
    region = RegionConfig(dim=dim, coord_feat_dim=32, size_feat_dim=32, inner_dim=64)
    return MoondreamConfig(text=text, vision=vision, region=region,
                           tokenizer=TokenizerConfig(templates=test_templates(tok)))


# eos logit offsets that make random tiny models stop after a handful of tokens/objects
# (found by trying a few seeds and images; random logits make the effect sharp).
TEST_EOS_BIAS = {"fast": 2.5, "reference": 3.0}


def make_test_model(out_dir, seed: int = 0, fast: bool = False, old_layout: bool = False,
                    dtype=None, real_shapes: bool = False, device="cpu",
                    config: MoondreamConfig | None = None) -> Path:
    """Write model.safetensors + config.json + tokenizer.json of a random model: tiny by
    default, Moondream 2's real shapes with `real_shapes` (bf16 unless `dtype` says otherwise),
    or the shapes of `config`. Tensors are generated on `device` and written one by one."""
    from safetensors.torch import save_file

    from .weights import TEST_MODEL_KEY, _OLD_TRANSPOSED, old_layout_name, random_weights

    if real_shapes and (fast or config is not None):
        raise ValueError("real_shapes cannot be combined with fast or config")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer()
    if real_shapes:
        cfg = MoondreamConfig()          # every field the real Moondream 2 default
    elif config is not None:
        cfg = config
    else:
        cfg = tiny_config(tok, fast=fast)
    if dtype is None:
        dtype = torch.bfloat16 if real_shapes else torch.float32
    # random real-shape models get no eos bias: every answer runs to its limit (the worst case)
    bias = 0.0 if real_shapes or config is not None else TEST_EOS_BIAS["fast" if fast else "reference"]
    w = random_weights(cfg, device, dtype, seed, eos_bias=bias)
    tensors = {}
    for k in list(w.keys()):
        v = w[k]
        del w[k]                          # keep one copy of each tensor, not two
        if old_layout:
            tensors[old_layout_name(k)] = (v.T if k in _OLD_TRANSPOSED else v).contiguous().cpu()
        else:
            tensors["model." + k] = v.cpu()
    kind = ("real-shape (Moondream 2) random model" if real_shapes
            else "random test model" if config is not None else "tiny random test model")
    note = (f"{kind} (seed {seed}{', fast' if fast else ''}): its answers are meaningless")
    save_file(tensors, str(out / "model.safetensors"), metadata={TEST_MODEL_KEY: note})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    tok.save(str(out / "tokenizer.json"))
    _same_mode(out / "model.safetensors", out / "config.json")
    return out


def _same_mode(path: Path, like: Path) -> None:
    """safetensors writes its file 0600 (a private temp file renamed); give it the mode the
    other files got from the umask (usually 0644)."""
    path.chmod(like.stat().st_mode & 0o777)
