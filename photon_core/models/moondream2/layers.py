"""The few tensor operations every block is made of, reading weights by name.

`Weights` is a flat {name: tensor} dict in the checkpoint's current layout without the
`model.` prefix (e.g. "text.blocks.0.attn.qkv.weight"); the helpers take a name prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Weights(dict):
    """name -> tensor, plus linear / layer_norm / mlp applied by name prefix."""

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self[name + ".weight"], self[name + ".bias"])

    def layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self[name + ".weight"]
        return F.layer_norm(x, w.shape, w, self[name + ".bias"], eps=1e-5)

    def mlp(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """fc2(gelu_tanh(fc1(x))): the MLP shape used everywhere in Moondream."""
        return self.linear(F.gelu(self.linear(x, name + ".fc1"), approximate="tanh"),
                           name + ".fc2")

    @property
    def dtype(self) -> torch.dtype:
        return self["text.wte"].dtype

    @property
    def device(self) -> torch.device:
        return self["text.wte"].device
