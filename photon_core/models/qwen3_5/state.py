"""The decoder's per-sequence state: attention k/v of the full-attention layers AND the conv
and recurrent (fp32) states of the Gated DeltaNet layers, plus where the sequence stands.

`length` is the number of tokens consumed (the k/v write position); `rope_pos` the M-RoPE
position of the next text token (ahead of or behind `length` after an image: an image of
gh x gw merged tokens advances it by max(gh, gw), not by gh * gw). An image prefix state is
read-only; every task starts from `prefix.copy(capacity)` (copy-on-start), so one prefix
serves any number of tasks on the same frame.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import TextConfig


@dataclass
class HybridState:
    k: dict[int, torch.Tensor]            # layer -> [Hkv, capacity, D]
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]         # layer -> [1, conv_dim, K-1]
    recurrent: dict[int, torch.Tensor]    # layer -> [1, Hv, Dk, Dv] fp32
    length: int = 0
    rope_pos: int = 0
    tokens: list[int] = field(default_factory=list)   # ids consumed (image tokens included)

    @property
    def capacity(self) -> int:
        return next(iter(self.k.values())).shape[1] if self.k else 1 << 30

    @classmethod
    def empty(cls, cfg: TextConfig, capacity: int, device, dtype) -> "HybridState":
        kv = lambda: torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim, device=device,
                                 dtype=dtype)
        return cls(
            k={i: kv() for i in cfg.full_layers}, v={i: kv() for i in cfg.full_layers},
            conv={i: torch.zeros(1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, device=device,
                                 dtype=dtype) for i in cfg.linear_layers},
            recurrent={i: torch.zeros(1, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim, device=device,
                                      dtype=torch.float32) for i in cfg.linear_layers})

    def copy(self, capacity: int | None = None) -> "HybridState":
        """A private copy with room for `capacity` tokens (>= length)."""
        capacity = max(capacity or self.capacity, self.length)

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(t.shape[0], capacity, t.shape[2])
            out[:, :self.length] = t[:, :self.length]
            return out
        return HybridState(k={i: grow(t) for i, t in self.k.items()},
                           v={i: grow(t) for i, t in self.v.items()},
                           conv={i: t.clone() for i, t in self.conv.items()},
                           recurrent={i: t.clone() for i, t in self.recurrent.items()},
                           length=self.length, rope_pos=self.rope_pos, tokens=list(self.tokens))
