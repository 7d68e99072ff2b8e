"""Region heads: turning hidden states into coordinates/sizes and back.

Encoding (a value fed back into the decoder as the next input embedding):
  fourier(v) = [cos(2*pi * v @ F), sin(2*pi * v @ F)] with learned frequencies F
  coordinate (one scalar x or y): coord_encoder(fourier(x)),  F = coord_features [1, 128]
  size (w, h): size_encoder(fourier([w, h])),                 F = size_features [2, 256]
Decoding (from the decoder's last hidden state, before post_ln):
  coordinate = argmax(coord_decoder MLP) / 1024 bins, i.e. in [0, 1)
  size = 2 ** (bin / 1023 * 10 - 10) per dimension, bins from the size_decoder's 2 x 1024
  logits: a log scale from 1/1024 to 1 of the image side.
Both are computed in float32 torch arithmetic, as the reference does, so the values (and the
boxes made from them) are the reference's to the last bit, not just within 1e-8.
"""
from __future__ import annotations

import math

import torch

from .layers import Weights


def fourier(v: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * v @ freqs
    return torch.cat([f.cos(), f.sin()], dim=-1)


def encode_coordinate(w: Weights, coord: float) -> torch.Tensor:
    """A coordinate in [0, 1] -> input embedding [1, 1, dim]."""
    feats = w["region.coord_features"]
    v = torch.tensor([[coord]], device=feats.device, dtype=feats.dtype)
    return w.linear(fourier(v, feats), "region.coord_encoder").view(1, 1, -1)


def encode_size(w: Weights, width: float, height: float) -> torch.Tensor:
    """A (width, height) pair, as fractions of the image -> input embedding [1, 1, dim]."""
    feats = w["region.size_features"]
    v = torch.tensor([width, height], device=feats.device, dtype=feats.dtype)
    return w.linear(fourier(v, feats), "region.size_encoder").view(1, 1, -1)


def coordinate_logits(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    return w.mlp(hidden.reshape(-1), "region.coord_decoder")


def size_logits(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """-> [2, bins] logits for width and height."""
    return w.mlp(hidden.reshape(-1), "region.size_decoder").view(2, -1)


def bin_to_coordinate(index: int, bins: int) -> float:
    return float(torch.tensor(index) / bins)   # int64 / int: float32 true division


def coordinate_to_bin(coord: float, bins: int) -> int:
    return min(bins - 1, max(0, round(coord * bins)))


def bin_to_size(index: int, bins: int = 1024) -> float:
    exponent = torch.tensor(index, dtype=torch.float32) / (bins - 1) * 10.0 - 10.0
    return float(torch.pow(2.0, exponent))


def size_to_bin(size: float, bins: int = 1024) -> int:
    size = max(size, 2.0 ** -10)
    return min(bins - 1, max(0, round((math.log2(size) + 10.0) / 10.0 * (bins - 1))))


def decode_coordinate(w: Weights, hidden: torch.Tensor) -> float:
    logits = coordinate_logits(w, hidden)
    return bin_to_coordinate(int(logits.argmax()), logits.shape[-1])


def decode_size(w: Weights, hidden: torch.Tensor) -> tuple[float, float]:
    logits = size_logits(w, hidden)
    bins = logits.shape[-1]
    return bin_to_size(int(logits[0].argmax()), bins), bin_to_size(int(logits[1].argmax()), bins)
