"""A Qwen 3.5 checkpoint in the Hugging Face layout: finding its files and reading its tensors.

Files: config.json; model.safetensors, or model.safetensors.index.json + the shards it names;
tokenizer.json; the chat template (chat_template.jinja, else tokenizer_config.json's
"chat_template"); preprocessor_config.json (optional: Qwen 3.5's defaults apply). From a local
folder or a Hugging Face repo id via huggingface_hub (honours HF_HUB_OFFLINE). Only
safetensors are read. Tensors are checked against the names and shapes the config implies;
extra tensors (e.g. multi-token-prediction heads, "mtp.*") are ignored and counted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import Qwen35Config


class CheckpointError(ValueError):
    """A checkpoint folder or file this family cannot load."""


CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TEMPLATE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
PREPROCESSOR = "preprocessor_config.json"


def resolve(path_or_id: str, revision: str | None = None) -> dict:
    """-> {"config", "weights": [paths], "tokenizer", "template": str | None, "preprocessor"}."""
    p = Path(os.path.expanduser(str(path_or_id)))
    if p.is_dir():
        get = _local_getter(p)
    elif p.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise CheckpointError(f"model folder {path_or_id!r} not found (and it is not a Hugging "
                              "Face repo id like 'Qwen/Qwen3.5-0.8B')")
    else:
        get = _hub_getter(str(path_or_id), revision)
    files = {"config": get(CONFIG, True), "tokenizer": get(TOKENIZER, True),
             "preprocessor": get(PREPROCESSOR, False)}
    index = get(INDEX, False)
    if index is not None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files["weights"] = [get(name, True) for name in sorted(set(weight_map.values()))]
    else:
        single = get(SINGLE, False)
        if single is None:
            raise CheckpointError(f"{path_or_id}: neither {SINGLE} nor {INDEX} found (only "
                                  "safetensors checkpoints are loaded)")
        files["weights"] = [single]
    files["template"] = read_template(get(TEMPLATE, False), get(TOKENIZER_CONFIG, False))
    return files


def read_template(jinja: Path | None, tok_cfg: Path | None) -> str | None:
    if jinja is not None:
        return jinja.read_text()
    if tok_cfg is not None:
        try:
            t = json.loads(tok_cfg.read_text()).get("chat_template")
        except ValueError as e:
            raise CheckpointError(f"{tok_cfg}: invalid JSON ({e})") from None
        if isinstance(t, list):   # [{"name": "default", "template": ...}, ...]
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t
    return None


def _local_getter(folder: Path):
    def get(name: str, required: bool) -> Path | None:
        f = folder / name
        if f.is_file():
            return f
        if required:
            raise CheckpointError(f"{f} not found (a Qwen 3.5 folder needs {CONFIG}, {TOKENIZER} "
                                  f"and {SINGLE} or {INDEX} with its shards)")
        return None
    return get


def _hub_getter(repo: str, revision: str | None):
    from huggingface_hub import hf_hub_download

    def get(name: str, required: bool) -> Path | None:
        try:
            return Path(hf_hub_download(repo, name, revision=revision))
        except Exception as e:   # not cached while offline, missing file, network, unknown repo
            if not required:
                return None
            raise CheckpointError(f"cannot get {name} of Hugging Face repo {repo}@"
                                  f"{revision or 'main'} (HF_HUB_OFFLINE="
                                  f"{os.environ.get('HF_HUB_OFFLINE', 'unset')}): "
                                  f"{type(e).__name__}: {e}") from None
    return get


def load_config(path: Path) -> Qwen35Config:
    try:
        d = json.loads(Path(path).read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    return Qwen35Config.from_dict(d)


# -- tensor names ----------------------------------------------------------------------------
def expected_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the model reads (the Hugging Face layout)."""
    t, v = cfg.text, cfg.vision
    s: dict[str, tuple[int, ...]] = {}
    L = "model.language_model."
    s[L + "embed_tokens.weight"] = (t.vocab_size, t.hidden_size)
    s[L + "norm.weight"] = (t.hidden_size,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (t.vocab_size, t.hidden_size)
    kd = t.linear_num_key_heads * t.linear_key_head_dim
    vd = t.linear_num_value_heads * t.linear_value_head_dim
    for i, kind in enumerate(t.layer_types):
        p = f"{L}layers.{i}."
        s[p + "input_layernorm.weight"] = (t.hidden_size,)
        s[p + "post_attention_layernorm.weight"] = (t.hidden_size,)
        s[p + "mlp.gate_proj.weight"] = (t.intermediate_size, t.hidden_size)
        s[p + "mlp.up_proj.weight"] = (t.intermediate_size, t.hidden_size)
        s[p + "mlp.down_proj.weight"] = (t.hidden_size, t.intermediate_size)
        if kind == "linear_attention":
            a = p + "linear_attn."
            s[a + "in_proj_qkv.weight"] = (2 * kd + vd, t.hidden_size)
            s[a + "in_proj_z.weight"] = (vd, t.hidden_size)
            s[a + "in_proj_b.weight"] = (t.linear_num_value_heads, t.hidden_size)
            s[a + "in_proj_a.weight"] = (t.linear_num_value_heads, t.hidden_size)
            s[a + "conv1d.weight"] = (2 * kd + vd, 1, t.linear_conv_kernel_dim)
            s[a + "A_log"] = (t.linear_num_value_heads,)
            s[a + "dt_bias"] = (t.linear_num_value_heads,)
            s[a + "norm.weight"] = (t.linear_value_head_dim,)
            s[a + "out_proj.weight"] = (t.hidden_size, vd)
        else:
            a = p + "self_attn."
            s[a + "q_proj.weight"] = (2 * t.num_attention_heads * t.head_dim, t.hidden_size)
            s[a + "k_proj.weight"] = (t.num_key_value_heads * t.head_dim, t.hidden_size)
            s[a + "v_proj.weight"] = (t.num_key_value_heads * t.head_dim, t.hidden_size)
            s[a + "o_proj.weight"] = (t.hidden_size, t.num_attention_heads * t.head_dim)
            s[a + "q_norm.weight"] = (t.head_dim,)
            s[a + "k_norm.weight"] = (t.head_dim,)
    V = "model.visual."
    c = v.hidden_size
    s[V + "patch_embed.proj.weight"] = (c, v.in_channels, v.temporal_patch_size, v.patch_size,
                                        v.patch_size)
    s[V + "patch_embed.proj.bias"] = (c,)
    s[V + "pos_embed.weight"] = (v.num_position_embeddings, c)
    for i in range(v.depth):
        p = f"{V}blocks.{i}."
        for n, shape in (("norm1", (c,)), ("norm2", (c,))):
            s[p + n + ".weight"] = shape
            s[p + n + ".bias"] = shape
        for n, o, i_ in (("attn.qkv", 3 * c, c), ("attn.proj", c, c),
                         ("mlp.linear_fc1", v.intermediate_size, c),
                         ("mlp.linear_fc2", c, v.intermediate_size)):
            s[p + n + ".weight"] = (o, i_)
            s[p + n + ".bias"] = (o,)
    m = c * v.spatial_merge_size ** 2
    s[V + "merger.norm.weight"] = (c,)
    s[V + "merger.norm.bias"] = (c,)
    s[V + "merger.linear_fc1.weight"] = (m, m)
    s[V + "merger.linear_fc1.bias"] = (m,)
    s[V + "merger.linear_fc2.weight"] = (v.out_hidden_size, m)
    s[V + "merger.linear_fc2.bias"] = (v.out_hidden_size,)
    return s


def load_tensors(paths: list[Path], cfg: Qwen35Config, device, dtype: torch.dtype
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """-> ({name: tensor} on device, in dtype; A_log/dt_bias/norm weights stay fp32 when the
    checkpoint has them in fp32), number of ignored extra tensors)."""
    from safetensors import SafetensorError, safe_open

    want = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    extra = 0
    for path in paths:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in want:
                        extra += 1
                        continue
                    t = f.get_tensor(name)
                    if tuple(t.shape) != want[name]:
                        raise CheckpointError(f"{path.name}: {name} has shape {tuple(t.shape)}, "
                                              f"the config implies {want[name]}")
                    keep_fp32 = name.endswith(("A_log", "dt_bias")) and t.dtype == torch.float32
                    out[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
    missing = sorted(set(want) - set(out))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the config needs: "
                              f"{', '.join(missing[:5])}{more}")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.language_model.embed_tokens.weight"]
    return out, extra
