"""Gemma 4 config.json (model_type "gemma4") -> frozen dataclasses, with clear errors.

Only what the reference engine needs is read. Two spellings of the global (full attention)
layers' head size exist: transformers 5 writes `per_layer_config` ({"<layer>": {"head_dim":
512}}); older files carry `global_head_dim` (and `num_global_key_value_heads`, used only when
keys equal values). Both are accepted. Audio and MoE are not served (MoE is refused).
"""
from __future__ import annotations

from dataclasses import dataclass

SLIDING, FULL = "sliding_attention", "full_attention"


class ConfigError(ValueError):
    """A config.json this engine cannot serve, with what is wrong in it."""


@dataclass(frozen=True)
class RopeCfg:
    theta: float
    rotary_fraction: float = 1.0     # proportional RoPE: only this share of the pairs turn
    factor: float = 1.0


@dataclass(frozen=True)
class TextCfg:
    vocab_size: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    global_head_dim: int
    global_kv_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict                       # layer type -> RopeCfg
    eps: float
    final_softcap: float | None
    ple_dim: int                     # hidden_size_per_layer_input (0: no per-layer embeddings)
    ple_vocab: int
    n_kv_shared: int
    k_eq_v: bool
    double_wide_mlp: bool
    bidirectional: str | None        # None or "vision" (image tokens see each other in sliding layers)
    pad_id: int
    bos_id: int
    eos_ids: tuple[int, ...]
    max_positions: int

    def head_dim_of(self, i: int) -> int:
        return self.global_head_dim if self.layer_types[i] == FULL else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        return self.global_kv_heads if self.layer_types[i] == FULL else self.n_kv_heads

    def k_eq_v_of(self, i: int) -> bool:
        return self.k_eq_v and self.layer_types[i] == FULL

    @property
    def first_shared(self) -> int:
        return self.n_layers - self.n_kv_shared

    def kv_source(self, i: int) -> int:
        """The layer whose k/v layer i attends to: itself, or for the last n_kv_shared layers
        the last non-shared layer of the same type."""
        if i < self.first_shared:
            return i
        return max(j for j in range(self.first_shared) if self.layer_types[j] == self.layer_types[i])

    def mlp_width(self, i: int) -> int:
        return self.intermediate * (2 if self.double_wide_mlp and i >= self.first_shared else 1)


@dataclass(frozen=True)
class VisionCfg:
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    patch_size: int
    pool: int
    pos_table: int
    rope_theta: float
    eps: float
    clipped_linears: bool
    standardize: bool


@dataclass(frozen=True)
class Gemma4Cfg:
    text: TextCfg
    vision: VisionCfg
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    tied: bool


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"config.json: {where}.{key} is missing")
    return d[key]


def _text(t: dict) -> TextCfg:
    w = "text_config"
    if t.get("enable_moe_block"):
        raise ConfigError("config.json: text_config.enable_moe_block is true; the Gemma 4 MoE "
                          "models are not served by this engine (E2B/E4B are dense)")
    n = int(_need(t, "num_hidden_layers", w))
    types = t.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ConfigError(f"config.json: {len(types)} layer_types for {n} layers")
    bad = set(types) - {SLIDING, FULL}
    if bad:
        raise ConfigError(f"config.json: unknown layer types {sorted(bad)}")
    types[-1] = FULL                       # as transformers: the last layer is always global
    head_dim = int(_need(t, "head_dim", w))
    kv_heads = int(_need(t, "num_key_value_heads", w))
    k_eq_v = bool(t.get("attention_k_eq_v", False))
    plc = t.get("per_layer_config")
    if plc:
        over = {int(k): v for k, v in plc.items()}
        full = [i for i, ty in enumerate(types) if ty == FULL]
        gh = {over.get(i, {}).get("head_dim", head_dim) for i in full}
        gk = {over.get(i, {}).get("num_key_value_heads", kv_heads) for i in full}
        if len(gh) > 1 or len(gk) > 1:
            raise ConfigError("config.json: per_layer_config gives global layers different shapes")
        global_head_dim, global_kv = gh.pop(), gk.pop()
    else:
        global_head_dim = int(t.get("global_head_dim", 512))
        g = t.get("num_global_key_value_heads")
        global_kv = int(g) if (g is not None and k_eq_v) else kv_heads
    rp = t.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    rope = {}
    for ty in set(types):
        p = rp.get(ty)
        if p is None:
            raise ConfigError(f"config.json: rope_parameters has no entry for {ty}")
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ConfigError(f"config.json: rope_type {kind!r} ({ty}) is not supported")
        rope[ty] = RopeCfg(theta=float(p["rope_theta"]),
                           rotary_fraction=float(p.get("partial_rotary_factor", 1.0))
                           if kind == "proportional" else 1.0,
                           factor=float(p.get("factor", 1.0)) if kind == "proportional" else 1.0)
    bidir = t.get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise ConfigError(f"config.json: use_bidirectional_attention={bidir!r} is not supported "
                          "(only null or 'vision')")
    act = t.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"config.json: hidden_activation {act!r} is not supported")
    eos = t.get("eos_token_id", 1)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    n_shared = int(t.get("num_kv_shared_layers", 0))
    if not 0 <= n_shared < n:
        raise ConfigError(f"config.json: num_kv_shared_layers={n_shared} for {n} layers")
    cfg = TextCfg(
        vocab_size=int(_need(t, "vocab_size", w)), hidden=int(_need(t, "hidden_size", w)),
        intermediate=int(_need(t, "intermediate_size", w)), n_layers=n,
        n_heads=int(_need(t, "num_attention_heads", w)), n_kv_heads=kv_heads, head_dim=head_dim,
        global_head_dim=int(global_head_dim), global_kv_heads=int(global_kv),
        layer_types=tuple(types), sliding_window=int(t.get("sliding_window", 512)), rope=rope,
        eps=float(t.get("rms_norm_eps", 1e-6)), final_softcap=t.get("final_logit_softcapping"),
        ple_dim=int(t.get("hidden_size_per_layer_input") or 0),
        ple_vocab=int(t.get("vocab_size_per_layer_input", t["vocab_size"])),
        n_kv_shared=n_shared, k_eq_v=k_eq_v, double_wide_mlp=bool(t.get("use_double_wide_mlp")),
        bidirectional=bidir, pad_id=int(t.get("pad_token_id") or 0),
        bos_id=int(t.get("bos_token_id", 2)), eos_ids=tuple(int(e) for e in eos if e is not None),
        max_positions=int(t.get("max_position_embeddings", 131072)))
    if n_shared:
        shared_types = set(types[cfg.first_shared:])
        if not shared_types <= set(types[:cfg.first_shared]):
            raise ConfigError("config.json: a KV-shared layer type has no earlier layer to share from")
    for i in range(n):
        if cfg.n_heads % cfg.kv_heads_of(i):
            raise ConfigError(f"config.json: layer {i}: {cfg.n_heads} heads are not a multiple "
                              f"of {cfg.kv_heads_of(i)} k/v heads")
    return cfg


def _vision(v: dict) -> VisionCfg:
    w = "vision_config"
    rp = v.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    if rp.get("rope_type", "axial") != "axial":
        raise ConfigError(f"config.json: vision rope_type {rp.get('rope_type')!r} is not axial")
    hidden, heads = int(_need(v, "hidden_size", w)), int(_need(v, "num_attention_heads", w))
    return VisionCfg(
        hidden=hidden, intermediate=int(_need(v, "intermediate_size", w)),
        n_layers=int(_need(v, "num_hidden_layers", w)), n_heads=heads,
        n_kv_heads=int(v.get("num_key_value_heads", heads)),
        head_dim=int(v.get("head_dim") or hidden // heads), patch_size=int(v.get("patch_size", 16)),
        pool=int(v.get("pooling_kernel_size", 3)), pos_table=int(v.get("position_embedding_size", 10240)),
        rope_theta=float(rp.get("rope_theta", 100.0)), eps=float(v.get("rms_norm_eps", 1e-6)),
        clipped_linears=bool(v.get("use_clipped_linears", False)),
        standardize=bool(v.get("standardize", False)))


def parse_config(d: dict) -> Gemma4Cfg:
    mt = d.get("model_type")
    if mt != "gemma4":
        raise ConfigError(f"config.json: model_type is {mt!r}; the Gemma 4 family serves 'gemma4' "
                          "(an image-text checkpoint such as google/gemma-4-E2B-it)")
    if not isinstance(d.get("text_config"), dict):
        raise ConfigError("config.json: text_config is missing")
    if not isinstance(d.get("vision_config"), dict):
        raise ConfigError("config.json: vision_config is missing: this engine needs the vision tower")
    return Gemma4Cfg(text=_text(d["text_config"]), vision=_vision(d["vision_config"]),
                     image_token_id=int(d.get("image_token_id", 258_880)),
                     boi_token_id=int(d.get("boi_token_id", 255_999)),
                     eoi_token_id=int(d.get("eoi_token_id", 258_882)),
                     tied=bool(d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings", True))))
