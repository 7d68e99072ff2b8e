"""Several frames encoded in one pass: every frame's crops through the vision encoder at
once (batched GEMMs over all crops), one projection MLP over all frames, one batched
image-prefix prefill (prefix_prefill.py) -> one EncodedImage per frame.

    encs = model.encode_batch([frame_a, EncodeRequest(frame_b, crops="global"), frame_c])

Per frame the math is encode_image's: the vision encoder, LayerNorm, GEMMs and SDPA compute
each crop / row / (batch, head) alone. On the CPU in fp32 each EncodedImage is bit-identical
to encode_image's on the test shapes (test/core/test_encode_batch.py). At Moondream's real
widths two CPU kernel properties break that by ~1 ulp (measured, 1-layer real-width model,
640x480 frame batched with another): (1) torch's CPU GELU computes the last numel % 32
elements of a tensor with the scalar tanh and the rest with the vector one: a frame's last
16 vision-MLP values (729 x 4304 per crop) are in the tail alone and in the vector loop
inside a batch (2 of 28 M values differed); (2) with several threads the BLAS splits a long
K reduction (text fc2, K = 8192) across threads for one row count and not for another
(1.8e-4 on values of ~1e2). Both are ~1e-6 relative. bf16 on the CPU and CUDA: close, not
bitwise (other kernels for other row counts).

`encode_body` is the part after the crops, shared with the runtime's batched graphed encoder
(photon_core/fast/graphed_batch_encoder.py, one graph per frames' layout): static inputs (the
crops of all frames, concatenated) and output (the k/v of all frames). With the crops inside
the graph (graphed_batch_encoder.crops_in_graph) a frame's layout also holds its size
(pixel_layout) and the graph makes the crops from the uint8 frame (model.device_crops).

Crop modes (photon_core/encode_request.py): "overlap" = the global view + the local crops
(tiling by crops.select_tiling); "global" = the global view alone, whose features also stand
in for a (1, 1) local grid (crops.GLOBAL_TILING) - what the model computes for an image that
fits one crop, where the one local crop is the global view.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
import torch

from ...encode_request import unwrap
from ...ops.linear_gelu import linear_gelu
from . import text, vision, vision_fused
from .crops import crop_geometry
from .prefix_prefill import prefill_prefix


@dataclass(frozen=True)
class FrameLayout:
    """What fixes a frame's shapes inside a batched encode (a graph key)."""
    crops: str                 # "overlap" | "overlap:N" | "global"
    tiling: tuple[int, int]
    n_crops: int               # crops the vision encoder runs for this frame
    # (height, width) of the frame when its crops are made inside the encode (the graphed
    # encoder's in-graph crops: the input is the uint8 frame); None: the crops come in made
    size: tuple[int, int] | None = None


def frame_layout(x: torch.Tensor, tiling, crops: str) -> FrameLayout:
    return FrameLayout(crops, (int(tiling[0]), int(tiling[1])), int(x.shape[0]))


def pixel_layout(model, height: int, width: int, crops: str) -> FrameLayout:
    """The layout of a height x width frame whose crops are made inside the encode
    (model.crop_plan's, without any pixel work)."""
    v = model.config.vision
    tiling, n_crops, _ = crop_geometry(height, width, crops, v.crop_size, v.enc_patch_size,
                                       v.overlap_margin, v.max_crops)
    return FrameLayout(crops, (int(tiling[0]), int(tiling[1])), n_crops,
                       (int(height), int(width)))


def kv_buffer(model, n: int) -> torch.Tensor:
    """[n_layers, 2, n, Hkv, prefix_len, D] zeros on the model's device and dtype."""
    t, w = model.config.text, model.weights
    return torch.zeros(t.n_layers, 2, n, t.n_kv_heads, model.prefix_len, t.head_dim,
                       device=w.device, dtype=w.dtype)


def encode_body(model, x: torch.Tensor, layouts: list[FrameLayout], kv: torch.Tensor, *,
                fast: bool = False, cut=None) -> None:
    """x: the frames' normalized crops, concatenated in order [sum n_crops, 3, c, c];
    writes every frame's prefix k/v into kv [n_layers, 2, n, Hkv, P, D].
    fast=False: the reference's functions (vision.encoder, the span-attention prefill);
    fast=True: vision_fused.encoder, the projection's fc1 + GELU as one GEMM and
    prefix_prefill's fast form (close, not bitwise). cut: the fast vision encoder's graph
    cut hook (vision_fused.encoder)."""
    w, v, t = model.weights, model.config.vision, model.config.text
    features = vision_fused.encoder(w, v, x, cut=cut) if fast else vision.encoder(w, v, x)
    inputs, off = [], 0
    for lay in layouts:
        f = features[off:off + lay.n_crops]
        off += lay.n_crops
        if lay.crops == "global":          # the global view is also the (1, 1) local grid
            f = f.expand(2, *f.shape[1:])
        inputs.append(vision.projection_input(v, f, lay.tiling))
    stacked = torch.stack(inputs)
    if fast:    # fc1 + tanh-GELU as one GEMM on CUDA (ops/linear_gelu.py), as the encoder's
        tokens = w.linear(linear_gelu(stacked, w["vision.proj_mlp.fc1.weight"],
                                      w["vision.proj_mlp.fc1.bias"]), "vision.proj_mlp.fc2")
    else:
        tokens = w.mlp(stacked, "vision.proj_mlp")                       # [n, g*g, dim]
    bos = text.embed(w, torch.full((len(layouts), 1), model.config.tokenizer.bos_id,
                                   device=w.device))                     # [n, 1, dim]
    # (only the k/v are kept: the fused form stops at the last k/v write)
    prefill_prefix(w, t, torch.cat([bos, tokens], dim=1), kv, model.prefix_len, fast=fast,
                   hidden=False)


def frame_crops(model, images: list, crops: str | None):
    """-> per image (array, crops tensor, tiling, crop mode), as model.image_crops makes them."""
    out = []
    for im in images:
        image, mode = unwrap(im, crops, model.crops)
        array, x, tiling = model.image_crops(image, mode)
        out.append((array, x, tiling, mode))
    return out


def split_encodings(model, frames, kv: torch.Tensor, t0: float,
                    setup_ms: float = 0.0) -> list:
    """One EncodedImage per frame, each owning its k/v ([n_layers, 2, 1, Hkv, P, D],
    contiguous); encode_ms: the frame's share of the call."""
    from .model import EncodedImage, _sync

    _sync(model.weights.device)
    ms = (time.perf_counter() - t0) * 1e3 / max(1, len(frames))
    return [EncodedImage(kv=kv[:, :, i:i + 1].clone(), width=a.shape[1], height=a.shape[0],
                         tiling=tuple(tiling), crops=mode, encode_ms=ms,
                         setup_ms=setup_ms / len(frames), model_id=model.model_id)
            for i, (a, _, tiling, mode) in enumerate(frames)]


def encode_batch(model, images: list, crops: str | None = None) -> list:
    """The reference engine's encode_batch (MoondreamModel.encode_batch): EncodedImages
    given pass through; the rest are encoded in one vision pass + one prefix prefill."""
    from .model import EncodedImage

    images = list(images)
    todo = [i for i, im in enumerate(images) if not isinstance(im, EncodedImage)]
    out = list(images)
    if not todo:
        return out
    t0 = time.perf_counter()
    frames = frame_crops(model, [images[i] for i in todo], crops)
    with torch.inference_mode():
        kv = kv_buffer(model, len(frames))
        encode_body(model, torch.cat([x for _, x, _, _ in frames]),
                    [frame_layout(x, tiling, mode) for _, x, tiling, mode in frames], kv)
    for i, enc in zip(todo, split_encodings(model, frames, kv, t0)):
        out[i] = enc
    return out


__all__ = ["FrameLayout", "encode_batch", "encode_body", "frame_crops", "frame_layout",
           "kv_buffer", "pixel_layout", "split_encodings"]
