"""encode_image as CUDA graphs, one per crop tiling: the reference's own functions, replayed.

The reference encode (vision encoder over the crops, projection, then the 730-token image
prefix through the text decoder) is launch-bound on the GPU: ~25 ms of the image-prefix
prefill is kernel launches. Here the part after the crops runs as one graph per tiling
(the crop count and the stitching depend on it), captured the first time a tiling is seen
(a 640x480 frame always gives (2, 4)). Inside the graph are exactly the reference's calls -
vision.encoder, vision.project, text.embed, text.decoder into a static KVCache - so the
result is the reference's, bit for bit; only the normalized crops are copied in and the
prefix k/v copied out (each EncodedImage owns its k/v). The crops themselves come from
model.image_crops, outside the graph: on a CUDA model the torch LANCZOS crops on the GPU
(model.crops_on_device; the same pixels as PIL's), elsewhere PIL on the CPU.
On the CPU the same body runs eagerly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.moondream2 import text, vision
from ..models.moondream2.kv_cache import KVCache
from ..models.moondream2.model import EncodedImage


@dataclass
class _Entry:
    crops: torch.Tensor          # static input [N, 3, crop, crop]
    cache: KVCache               # static output (prefix k/v)
    graph: object = None


class GraphedEncoder:
    def __init__(self, model, use_graphs: bool):
        self.model = model
        self.use_graphs = use_graphs
        self.entries: dict[tuple, _Entry] = {}
        w = model.weights
        self.bos = torch.tensor([model.config.tokenizer.bos_id], device=w.device)
        self.capture_ms = 0.0
        self.capture_stream = None   # set by FastEngine: its own stream (fast_engine.py)

    def _body(self, e: _Entry, tiling) -> None:
        m = self.model
        w, v, t = m.weights, m.config.vision, m.config.text
        features = vision.encoder(w, v, e.crops)
        tokens = vision.project(w, v, features, tiling)
        prefix = torch.cat([text.embed(w, self.bos), tokens], dim=0)[None]
        e.cache.length = 0
        text.decoder(w, t, prefix, 0, e.cache, m.prefix_len)

    def _entry(self, x: torch.Tensor, tiling) -> _Entry:
        key = (tuple(tiling), tuple(x.shape))
        e = self.entries.get(key)
        if e is not None:
            return e
        m, t = self.model, self.model.config.text
        w = m.weights
        e = _Entry(crops=torch.empty_like(x),
                   cache=KVCache(t.n_layers, t.n_kv_heads, m.prefix_len, t.head_dim,
                                 w.device, w.dtype))
        if self.use_graphs:
            t0 = time.perf_counter()
            e.crops.copy_(x)
            side = self.capture_stream or torch.cuda.Stream()   # warm-up
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body(e, tiling)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=self.capture_stream):
                self._body(e, tiling)
            torch.cuda.synchronize()
            e.graph = g
            self.capture_ms += (time.perf_counter() - t0) * 1e3
        self.entries[key] = e
        return e

    def encode(self, image) -> EncodedImage:
        if isinstance(image, EncodedImage):
            return image
        m = self.model
        t0 = time.perf_counter()
        array, x, tiling = m.image_crops(image)
        w = m.weights
        with torch.inference_mode():
            captured_before = self.capture_ms
            e = self._entry(x, tiling)              # captures a graph for a new tiling
            setup_ms = self.capture_ms - captured_before
            e.crops.copy_(x)
            if e.graph is not None:
                e.graph.replay()
            else:
                self._body(e, tiling)
            kv = e.cache.data.clone()
        if w.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return EncodedImage(kv=kv, width=array.shape[1], height=array.shape[0], tiling=tiling,
                            encode_ms=(time.perf_counter() - t0) * 1e3, model_id=m.model_id,
                            setup_ms=setup_ms)
