"""Qwen 3.5 configuration read from a Hugging Face config.json (model_type "qwen3_5").

Plain frozen dataclasses; field names follow config.json. Missing required fields, unknown
layer types or an M-RoPE layout that does not fit the head give a ConfigError that says which
field is wrong. Nothing here needs transformers.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

MODEL_TYPES = ("qwen3_5",)


class ConfigError(ValueError):
    """A config.json this family cannot serve."""


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    layer_types: tuple[str, ...]
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None

    @property
    def rot_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))


@dataclass(frozen=True)
class Qwen35Config:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen35Config":
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError(f"config.json model_type is {mt!r}; the qwen3.5 family serves "
                              f"{', '.join(MODEL_TYPES)}")
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"config.json has no {key} (a Qwen 3.5 multimodal checkpoint "
                                  "needs both text_config and vision_config)")
        text = _text(d["text_config"])
        vision = _vision(d["vision_config"])
        if vision.out_hidden_size != text.hidden_size:
            raise ConfigError(f"vision_config.out_hidden_size {vision.out_hidden_size} != "
                              f"text_config.hidden_size {text.hidden_size}")
        tie = bool(d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings", False)))
        return cls(text=text, vision=vision, tie_word_embeddings=tie,
                   image_token_id=int(d.get("image_token_id", 248056)),
                   video_token_id=int(d.get("video_token_id", 248057)),
                   vision_start_token_id=int(d.get("vision_start_token_id", 248053)),
                   vision_end_token_id=int(d.get("vision_end_token_id", 248054)))


def _pick(d: dict, cls, where: str, **override) -> dict:
    out = {}
    for f in fields(cls):
        if f.name in override:
            out[f.name] = override[f.name]
        elif f.name in d and d[f.name] is not None:
            out[f.name] = d[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:   # required
            raise ConfigError(f"config.json {where}.{f.name} is missing")
    return out


def _text(d: dict) -> TextConfig:
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json text_config.rope_parameters.rope_theta is missing")
    n = d.get("num_hidden_layers")
    if n is None:
        raise ConfigError("config.json text_config.num_hidden_layers is missing")
    layer_types = d.get("layer_types")
    if layer_types is None:
        every = int(d.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                       for i in range(n)]
    bad = set(layer_types) - {"full_attention", "linear_attention"}
    if bad or len(layer_types) != n:
        raise ConfigError(f"config.json text_config.layer_types must list {n} of "
                          f"'full_attention'/'linear_attention', got {layer_types}")
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    cfg = TextConfig(**_pick(d, TextConfig, "text_config", layer_types=tuple(layer_types),
                             rope_theta=float(theta),
                             partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
                             mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
                             eos_token_id=eos))
    if d.get("attn_output_gate", True) is not True:
        raise ConfigError("text_config.attn_output_gate false is not supported (Qwen 3.5 gates "
                          "its attention output)")
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"text_config rope_type {rope.get('rope_type')!r} is not supported "
                          "(only 'default' M-RoPE)")
    if rope.get("mrope_interleaved", True) is not True:
        raise ConfigError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
    if sum(cfg.mrope_section) != cfg.rot_dim // 2:
        raise ConfigError(f"mrope_section {list(cfg.mrope_section)} must sum to rot_dim/2 = "
                          f"{cfg.rot_dim // 2} (head_dim {cfg.head_dim} x partial_rotary_factor "
                          f"{cfg.partial_rotary_factor} / 2)")
    if cfg.num_attention_heads % cfg.num_key_value_heads or \
            cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("head counts must divide: num_attention_heads by num_key_value_heads "
                          "and linear_num_value_heads by linear_num_key_heads")
    return cfg


def _vision(d: dict) -> VisionConfig:
    rope = d.get("rope_parameters") or {}
    for k in ("patch_size", "temporal_patch_size"):
        if isinstance(d.get(k), (list, tuple)):
            raise ConfigError(f"vision_config.{k} as a list is not supported")
    cfg = VisionConfig(**_pick(d, VisionConfig, "vision_config",
                               rope_theta=float(rope.get("rope_theta", 10000.0))))
    if cfg.grid_side ** 2 != cfg.num_position_embeddings:
        raise ConfigError(f"vision_config.num_position_embeddings {cfg.num_position_embeddings} "
                          "is not a square")
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise ConfigError("vision hidden_size / num_heads must be a multiple of 4")
    return cfg
