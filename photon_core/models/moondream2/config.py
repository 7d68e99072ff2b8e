"""Moondream 2 configuration: plain frozen dataclasses.

The dict form ({"text": {...}, "vision": {...}, "region": {...}, "tokenizer": {...}}) and the
field names follow the reference implementation's config, so one config.json works for both;
any field left out takes the Moondream 2 default below.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730          # BOS + 729 image tokens attend bidirectionally
    group_size: int | None = None   # quantization group (unused by the reference path)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rot_dim(self) -> int:
        """Rotary embedding covers the first half of every head (32 of 64 dims)."""
        return self.head_dim // 2


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192

    @property
    def grid(self) -> int:
        """Patches per side of one crop (27)."""
        return self.crop_size // self.enc_patch_size


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None


def _default_templates() -> dict:
    return {
        "caption": {
            "short": [1, 32708, 2, 12492, 3],
            "normal": [1, 32708, 2, 6382, 3],
            "long": [1, 32708, 2, 4059, 3],
        },
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: dict = field(default_factory=_default_templates)


_MAX_FIELD = 1 << 20   # no real dimension/count is larger; bigger values are typos or attacks


def _check_int(where: str, v, optional: bool = False, lo: int = 1) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_FIELD:
        raise ValueError(f"config.json: {where} must be an integer in {lo}..{_MAX_FIELD}, "
                         f"got {v!r:.60}")


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    @property
    def prefix_len(self) -> int:
        """BOS + one token per image patch of the global crop (730)."""
        return 1 + self.vision.grid ** 2

    @classmethod
    def from_dict(cls, d: dict | None) -> "MoondreamConfig":
        """Reads the reference dict form; also accepts a Hugging Face config.json that
        wraps it under "config" (HfConfig). Unknown sections are ignored, unknown fields
        inside a section are an error."""
        d = dict(d or {})
        if not any(k in d for k in ("text", "vision", "region", "tokenizer")) and isinstance(
                d.get("config"), dict):
            d = d["config"]
        parts = {}
        for name, klass in (("text", TextConfig), ("vision", VisionConfig),
                            ("region", RegionConfig), ("tokenizer", TokenizerConfig)):
            section = d.get(name) or {}
            if not isinstance(section, dict):
                raise ValueError(f"config.json: {name} must be an object, got {section!r:.60}")
            known = {f.name for f in dataclasses.fields(klass)}
            unknown = sorted(set(section) - known)
            if unknown:
                raise ValueError(f"config.json: unknown {name} fields {unknown}")
            for f in dataclasses.fields(klass):
                if f.name in section and f.name != "templates":
                    _check_int(f"{name}.{f.name}", section[f.name], optional=f.default is None,
                               lo=0 if name == "tokenizer" or f.name == "overlap_margin" else 1)
            if not isinstance(section.get("templates", {}), dict):
                raise ValueError("config.json: tokenizer.templates must be an object")
            parts[name] = klass(**section)
        cfg = cls(**parts)
        cfg.check()
        return cfg

    @classmethod
    def from_file(cls, path) -> "MoondreamConfig":
        """Read a config.json; every problem is a ValueError that names the file."""
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            msg = str(e).removeprefix("config.json: ")
            raise ValueError(f"{path}: {msg}") from None

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name))
                for name in ("text", "vision", "region", "tokenizer")}

    def check(self) -> None:
        t, v, r = self.text, self.vision, self.region
        if t.dim % t.n_heads or t.n_heads % t.n_kv_heads or t.head_dim % 4:
            raise ValueError(f"text: dim {t.dim}, n_heads {t.n_heads}, n_kv_heads "
                             f"{t.n_kv_heads} do not give whole (even) heads")
        if v.enc_dim % v.enc_n_heads or v.crop_size % v.enc_patch_size:
            raise ValueError("vision: enc_dim/enc_n_heads or crop_size/patch not whole")
        if v.grid <= 2 * v.overlap_margin:
            raise ValueError("vision: crop too small for its overlap margin")
        if v.proj_out_dim != t.dim or r.dim != t.dim:
            raise ValueError(f"vision.proj_out_dim {v.proj_out_dim} and region.dim {r.dim} "
                             f"must equal text.dim {t.dim}")
        if r.size_out_dim % 2:
            raise ValueError("region.size_out_dim must be 2 x bins")
        if self.prefix_len >= t.max_context:
            raise ValueError("text.max_context leaves no room after the image prefix")
