"""Checkpoint layout: expected tensor names/shapes, the older layout, loading and checks.

Names are the current Hugging Face layout without its `model.` prefix (torch.compile's
`._orig_mod` segments are stripped). Linear weights are [out, in]. Only safetensors are read.
"""
from __future__ import annotations

import torch

from .config import MoondreamConfig
from .layers import Weights


class WeightsError(ValueError):
    """A checkpoint that does not match the configuration, or cannot be read."""


# safetensors metadata key that make_test_model writes: its value says the weights are random
TEST_MODEL_KEY = "photon_test_model"


def _linear(name: str, out_dim: int, in_dim: int) -> dict:
    return {name + ".weight": (out_dim, in_dim), name + ".bias": (out_dim,)}


def _norm(name: str, dim: int) -> dict:
    return {name + ".weight": (dim,), name + ".bias": (dim,)}


def expected_shapes(cfg: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the model needs."""
    t, v, r = cfg.text, cfg.vision, cfg.region
    s: dict[str, tuple[int, ...]] = {}
    patch_dim = v.enc_patch_size ** 2 * v.in_channels
    s.update(_linear("vision.patch_emb", v.enc_dim, patch_dim))
    s["vision.pos_emb"] = (1, v.grid ** 2, v.enc_dim)
    for i in range(v.enc_n_layers):
        p = f"vision.blocks.{i}"
        s.update(_norm(p + ".ln1", v.enc_dim))
        s.update(_norm(p + ".ln2", v.enc_dim))
        s.update(_linear(p + ".attn.qkv", 3 * v.enc_dim, v.enc_dim))
        s.update(_linear(p + ".attn.proj", v.enc_dim, v.enc_dim))
        s.update(_linear(p + ".mlp.fc1", v.enc_ff_dim, v.enc_dim))
        s.update(_linear(p + ".mlp.fc2", v.enc_dim, v.enc_ff_dim))
    s.update(_norm("vision.post_ln", v.enc_dim))
    s.update(_linear("vision.proj_mlp.fc1", v.proj_inner_dim, 2 * v.enc_dim))
    s.update(_linear("vision.proj_mlp.fc2", v.proj_out_dim, v.proj_inner_dim))

    s["text.wte"] = (t.vocab_size, t.dim)
    qkv = (t.n_heads + 2 * t.n_kv_heads) * t.head_dim
    for i in range(t.n_layers):
        p = f"text.blocks.{i}"
        s.update(_norm(p + ".ln", t.dim))
        s.update(_linear(p + ".attn.qkv", qkv, t.dim))
        s.update(_linear(p + ".attn.proj", t.dim, t.dim))
        s.update(_linear(p + ".mlp.fc1", t.ff_dim, t.dim))
        s.update(_linear(p + ".mlp.fc2", t.dim, t.ff_dim))
    s.update(_norm("text.post_ln", t.dim))
    s.update(_linear("text.lm_head", t.vocab_size, t.dim))

    s["region.coord_features"] = (1, r.coord_feat_dim // 2)
    s["region.size_features"] = (2, r.size_feat_dim // 2)
    s.update(_linear("region.coord_encoder", r.dim, r.coord_feat_dim))
    s.update(_linear("region.coord_decoder.fc1", r.inner_dim, r.dim))
    s.update(_linear("region.coord_decoder.fc2", r.coord_out_dim, r.inner_dim))
    s.update(_linear("region.size_encoder", r.dim, r.size_feat_dim))
    s.update(_linear("region.size_decoder.fc1", r.inner_dim, r.dim))
    s.update(_linear("region.size_decoder.fc2", r.size_out_dim, r.inner_dim))
    return s


# Older layout: (old prefix, new prefix), applied to the start of a name, first match wins.
_OLD_PREFIXES = [
    ("vision_encoder.encoder.model.visual.patch_embed.linear", "vision.patch_emb"),
    ("vision_encoder.encoder.model.visual.pos_embed", "vision.pos_emb"),
    ("vision_encoder.encoder.model.visual.norm", "vision.post_ln"),
    ("vision_encoder.encoder.model.visual.blocks", "vision.blocks"),
    ("vision_encoder.projection.mlp", "vision.proj_mlp"),
    ("text_model.transformer.embd.wte.weight", "text.wte"),
    ("text_model.transformer.h", "text.blocks"),
    ("text_model.lm_head.ln", "text.post_ln"),
    ("text_model.lm_head.linear", "text.lm_head"),
    ("region_model.coordinate_features.weight", "region.coord_features"),
    ("region_model.size_features.weight", "region.size_features"),
    ("region_model.coordinate_encoder", "region.coord_encoder"),
    ("region_model.coordinate_decoder", "region.coord_decoder"),
    ("region_model.size_encoder", "region.size_encoder"),
    ("region_model.size_decoder", "region.size_decoder"),
]
# Inside blocks: old segment -> new segment.
_OLD_SEGMENTS = {".norm1.": ".ln1.", ".norm2.": ".ln2.", ".mixer.Wqkv.": ".attn.qkv.",
                 ".mixer.out_proj.": ".attn.proj."}
# The old layout stores the Fourier frequency matrices as Linear weights [n, in]: transposed.
_OLD_TRANSPOSED = ("region.coord_features", "region.size_features")


def is_old_layout(names) -> bool:
    return any(n.startswith(("vision_encoder.", "text_model.", "region_model.")) for n in names)


def normalize_name(name: str) -> str:
    """Current-layout name of a checkpoint tensor (old layout converted)."""
    name = name.replace("._orig_mod", "")
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in _OLD_PREFIXES:
        if name == old or name.startswith(old + "."):
            name = new + name[len(old):]
            break
    for old, new in _OLD_SEGMENTS.items():
        name = name.replace(old, new)
    return name


def old_layout_name(name: str) -> str:
    """Inverse of normalize_name for one current name (used to write old-layout test files)."""
    for old, new in _OLD_SEGMENTS.items():
        if name.startswith("vision.blocks.") or name.startswith("text.blocks."):
            if new in name and ((new.startswith(".ln") and name.startswith("vision."))
                                or (new.startswith(".attn") and name.startswith("text."))):
                name = name.replace(new, old)
    for old, new in _OLD_PREFIXES:
        if name == new or name.startswith(new + "."):
            return old + name[len(new):]
    return name


def load_safetensors(path, cfg: MoondreamConfig, device, dtype, progress: bool = True) -> Weights:
    """Read, convert, validate and place every tensor; errors name the tensor and shapes."""
    from safetensors import safe_open
    from tqdm import tqdm

    want = expected_shapes(cfg)
    w = Weights()
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            old = is_old_layout(names)
            for name in tqdm(names, desc="loading tensors", unit="tensor", disable=not progress,
                             leave=False):
                new = normalize_name(name)
                if new not in want:
                    continue  # extra tensors (e.g. other heads) are not needed here
                t = f.get_tensor(name)
                if old and new in _OLD_TRANSPOSED:
                    t = t.T
                w[new] = t
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a bad file, one line
        raise unreadable(path, e) from None
    return finish_weights(w, want, device, dtype, str(path))


def unreadable(path, e: Exception) -> WeightsError:
    """The error for a weights file safetensors cannot read (truncated, random bytes, a
    pickle renamed .safetensors, unreadable): names the file and what it saw, one line."""
    head = b""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        pass
    what = str(e).splitlines()[0] if str(e) else type(e).__name__
    if head[:1] == b"\x80" or head[:2] == b"PK":      # pickle protocol 2+ / torch.save zip
        hint = " It looks like a pickle / torch.save file: only safetensors are loaded (no pickle)."
    elif isinstance(e, OSError):
        hint = ""
    else:
        hint = " The file is truncated or corrupt: download or copy it again."
    return WeightsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {what})."
                        f"{hint}")


def read_metadata(path) -> dict[str, str]:
    """The safetensors header's __metadata__ ({} when none or unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - load_safetensors reports bad files
        return {}


def finish_weights(w: dict, want: dict, device, dtype, source: str) -> Weights:
    missing = [n for n in want if n not in w]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    out = Weights()
    for name, shape in want.items():
        t = w[name]
        if tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{source}: tensor {name} has shape {tuple(t.shape)}, "
                               f"expected {tuple(shape)} for this config")
        out[name] = t.to(device=device, dtype=dtype).contiguous()
    return out


def random_weights(cfg: MoondreamConfig, device="cpu", dtype=torch.float32, seed: int = 0,
                   eos_bias: float = 0.0) -> Weights:
    """Random weights of the config's shapes, generated directly on `device`.

    Linear weights ~ N(0, 1/in), biases small, LayerNorms identity-ish, Fourier frequencies
    ~ N(0, 1) (as trained ones are of order 1..10). `eos_bias` is added to the lm_head bias of
    the eos token so that random models stop after a few tokens/objects now and then.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    w = Weights()
    for name, shape in expected_shapes(cfg).items():
        def randn(*s, std=1.0):
            return torch.randn(*s, generator=gen, device=device, dtype=torch.float32) * std
        if name.endswith((".ln.weight", ".ln1.weight", ".ln2.weight", "post_ln.weight")):
            t = 1.0 + randn(*shape, std=0.05)
        elif name.endswith(".bias"):
            t = randn(*shape, std=0.02)
        elif name.endswith("_features"):
            t = randn(*shape, std=1.0)
        elif name in ("text.wte", "vision.pos_emb"):
            t = randn(*shape, std=0.5)
        else:
            t = randn(*shape, std=shape[-1] ** -0.5)
        if name == "text.lm_head.bias":
            t[cfg.tokenizer.eos_id] += eos_bias
        w[name] = t.to(dtype).contiguous()   # cast one by one: no full fp32 copy at 2B params
    return w
