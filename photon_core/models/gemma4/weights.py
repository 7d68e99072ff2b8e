"""Gemma 4 tensors: the expected names and shapes of an HF checkpoint, loading them from one
model.safetensors or from shards listed in model.safetensors.index.json, clear errors.

Names are kept as in the checkpoint without the leading "model." (e.g.
"language_model.layers.0.self_attn.q_proj.weight"). The audio tower (model.audio_tower.*,
model.embed_audio.*) is not loaded. KV-shared layers have no k/v projections (a checkpoint
that still carries them is accepted; they are unused, as in transformers). Embeddings are
tied: lm_head is embed_tokens unless the checkpoint says otherwise and has lm_head.weight.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import Gemma4Cfg

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
IGNORED_PREFIXES = ("audio_tower.", "embed_audio.")
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


class WeightsError(ValueError):
    """A checkpoint whose tensors do not match its config.json."""


def text_layer(i: int, name: str) -> str:
    return f"language_model.layers.{i}.{name}"


def vision_layer(j: int, name: str) -> str:
    return f"vision_tower.encoder.layers.{j}.{name}"


def expected_shapes(cfg: Gemma4Cfg) -> dict[str, tuple[int, ...]]:
    t, v = cfg.text, cfg.vision
    H, L, P = t.hidden, t.n_layers, t.ple_dim
    s: dict[str, tuple[int, ...]] = {
        "language_model.embed_tokens.weight": (t.vocab_size, H),
        "language_model.norm.weight": (H,),
    }
    if P:
        s["language_model.embed_tokens_per_layer.weight"] = (t.ple_vocab, L * P)
        s["language_model.per_layer_model_projection.weight"] = (L * P, H)
        s["language_model.per_layer_projection_norm.weight"] = (P,)
    for i in range(L):
        D, kvh, I = t.head_dim_of(i), t.kv_heads_of(i), t.mlp_width(i)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            s[text_layer(i, n + ".weight")] = (H,)
        s[text_layer(i, "layer_scalar")] = (1,)
        s[text_layer(i, "self_attn.q_proj.weight")] = (t.n_heads * D, H)
        s[text_layer(i, "self_attn.q_norm.weight")] = (D,)
        s[text_layer(i, "self_attn.o_proj.weight")] = (H, t.n_heads * D)
        if i < t.first_shared:
            s[text_layer(i, "self_attn.k_proj.weight")] = (kvh * D, H)
            s[text_layer(i, "self_attn.k_norm.weight")] = (D,)
            if not t.k_eq_v_of(i):
                s[text_layer(i, "self_attn.v_proj.weight")] = (kvh * D, H)
        s[text_layer(i, "mlp.gate_proj.weight")] = (I, H)
        s[text_layer(i, "mlp.up_proj.weight")] = (I, H)
        s[text_layer(i, "mlp.down_proj.weight")] = (H, I)
        if P:
            s[text_layer(i, "per_layer_input_gate.weight")] = (P, H)
            s[text_layer(i, "per_layer_projection.weight")] = (H, P)
            s[text_layer(i, "post_per_layer_input_norm.weight")] = (H,)
    Hv, Dv = v.hidden, v.head_dim
    s["vision_tower.patch_embedder.input_proj.weight"] = (Hv, 3 * v.patch_size ** 2)
    s["vision_tower.patch_embedder.position_embedding_table"] = (2, v.pos_table, Hv)
    lin = {"self_attn.q_proj": (v.n_heads * Dv, Hv), "self_attn.k_proj": (v.n_kv_heads * Dv, Hv),
           "self_attn.v_proj": (v.n_kv_heads * Dv, Hv), "self_attn.o_proj": (Hv, v.n_heads * Dv),
           "mlp.gate_proj": (v.intermediate, Hv), "mlp.up_proj": (v.intermediate, Hv),
           "mlp.down_proj": (Hv, v.intermediate)}
    for j in range(v.n_layers):
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            s[vision_layer(j, n + ".weight")] = (Hv,)
        s[vision_layer(j, "self_attn.q_norm.weight")] = (Dv,)
        s[vision_layer(j, "self_attn.k_norm.weight")] = (Dv,)
        for n, shape in lin.items():
            s[vision_layer(j, n + ".linear.weight")] = shape
            if v.clipped_linears:
                for b in CLIP_BOUNDS:
                    s[vision_layer(j, f"{n}.{b}")] = ()
    if v.standardize:
        s["vision_tower.std_bias"] = (Hv,)
        s["vision_tower.std_scale"] = (Hv,)
    s["embed_vision.embedding_projection.weight"] = (H, Hv)
    if not cfg.tied:
        s["lm_head.weight"] = (t.vocab_size, H)
    return s


def _strip(name: str) -> str | None:
    """Checkpoint name -> our key (None: not ours to load)."""
    if name == "lm_head.weight":
        return name
    if not name.startswith("model."):
        return "?" + name
    key = name[len("model."):]
    return None if key.startswith(IGNORED_PREFIXES) else key


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (index first, else model.safetensors)."""
    idx = folder / INDEX
    if idx.is_file():
        try:
            wmap = json.loads(idx.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightsError(f"{idx}: not a safetensors index ({e})") from None
        files = sorted(set(wmap.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise WeightsError(f"{idx} lists shards that are not in {folder}: {missing}")
        return [folder / f for f in files]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise WeightsError(f"{folder} has neither {INDEX} nor {SINGLE}")


PER_LAYER_TABLE = "language_model.embed_tokens_per_layer.weight"


def load_weights(files: list[Path], cfg: Gemma4Cfg, device="cpu",
                 dtype: torch.dtype = torch.float32,
                 cpu_keys: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """cpu_keys: tensors kept in host memory whatever `device` is (the per-layer embedding
    table: E2B's is 4.7 GB in bf16, read a few rows per token)."""
    from safetensors import safe_open

    want = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    unexpected = []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:
            raise WeightsError(f"{f}: cannot read as safetensors: {e}") from None
        with handle:
            for name in handle.keys():
                key = _strip(name)
                if key is None:
                    continue
                if key not in want:
                    if not _is_unused_shared_kv(key, cfg):
                        unexpected.append(name)
                    continue
                t = handle.get_tensor(name)
                if tuple(t.shape) != want[key]:
                    raise WeightsError(f"{f.name}: {name} has shape {tuple(t.shape)}, config.json "
                                       f"implies {want[key]}")
                out[key] = t.to(device="cpu" if key in cpu_keys else device,
                                dtype=dtype if t.is_floating_point() else t.dtype)
    missing = sorted(set(want) - set(out))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"checkpoint lacks {len(missing)} tensors its config.json needs: "
                           f"{missing[:5]}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise WeightsError(f"checkpoint has {len(unexpected)} tensors its config.json does not "
                           f"explain: {unexpected[:5]}{more}")
    return out


def _is_unused_shared_kv(key: str, cfg: Gemma4Cfg) -> bool:
    parts = key.split(".")
    if len(parts) < 5 or parts[:2] != ["language_model", "layers"] or not parts[2].isdigit():
        return False
    return (int(parts[2]) >= cfg.text.first_shared and parts[3] == "self_attn"
            and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))


def lm_head(w: dict[str, torch.Tensor]) -> torch.Tensor:
    return w.get("lm_head.weight", w["language_model.embed_tokens.weight"])
