"""encode_batch for the runtime: several frames' crops in one vision pass and one batched
image-prefix prefill (models/moondream2/batched_encode.encode_body), as one CUDA graph per
frames' layout, with a bounded number of graphs.

Layout of a batch: the frames' (crop mode, tiling, crop count), sorted (frames are encoded
in that canonical order and handed back in the caller's, so cameras A, B and B, A share one
graph). A 640x480 camera always has the same layout, so k cameras of one resolution need
one graph per batch size.

Graphs: a single-frame layout is captured the first time it is seen (as graphed_encoder.py
does per tiling). n frames of one layout with graphs of that layout at other batch sizes run
as those (7 -> 4 + 2 + 1; `prepare` captures sizes 1, 2, 4, 8 ahead). Otherwise a
multi-frame layout is captured the second time it is seen (a one-off mix of cameras is not
worth a ~0.3-1 s capture); until then, and for any layout once `max_batch_graphs`
multi-frame graphs exist, the batch is encoded frame by frame through the single-frame
graphs (correct, the speed of one-at-a-time). Graphs are never evicted:
freeing a graph can free the cuBLAS workspace under other graphs captured on the same
stream (pytorch/pytorch#193402, fast_engine.py), so the bound is on captures. Batches larger
than `max_frames` are encoded in chunks.

fast=True runs the faster equivalent forms (vision_fused.py, prefix_prefill's fast form:
close to the reference, not bitwise); fast=False the reference's functions (on the CPU each
frame bit-identical to encode_image; on CUDA the batched GEMMs may round differently).
On the CPU (no graphs) the same body runs eagerly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..encode_request import unwrap
from ..models.moondream2.batched_encode import (FrameLayout, encode_body, frame_layout,
                                                 kv_buffer)


@dataclass
class _Entry:
    layouts: tuple[FrameLayout, ...]
    x: torch.Tensor            # static input: the frames' crops, concatenated
    kv: torch.Tensor           # static output [n_layers, 2, n, Hkv, P, D]
    graph: object = None


class GraphedBatchEncoder:
    def __init__(self, model, use_graphs: bool, fast: bool = False, max_batch_graphs: int = 4,
                 max_frames: int = 8, default_crops: str = "overlap"):
        self.model = model
        self.use_graphs = use_graphs
        self.fast = fast
        self.max_batch_graphs = max_batch_graphs
        self.max_frames = max(1, max_frames)
        self.default_crops = default_crops
        self.entries: dict[tuple, _Entry] = {}
        self.seen: dict[tuple, int] = {}        # multi-frame layouts seen, not captured
        self.capture_ms = 0.0
        self.capture_stream = None              # set by FastEngine (its own stream)
        # calls: one frame / several in one graph / split over captured sizes / one by one
        self.counts = {"single": 0, "batched": 0, "split": 0, "frame_by_frame": 0,
                       "captures": 0}

    # -- graphs ----------------------------------------------------------------------------
    def _body(self, e: _Entry) -> None:
        encode_body(self.model, e.x, list(e.layouts), e.kv, fast=self.fast)

    def _new_entry(self, key: tuple, x: torch.Tensor) -> _Entry:
        e = _Entry(layouts=key, x=torch.empty_like(x), kv=kv_buffer(self.model, len(key)))
        t0 = time.perf_counter()
        e.x.copy_(x)
        e.graph = self._capture(e)
        self.capture_ms += (time.perf_counter() - t0) * 1e3
        self.counts["captures"] += 1
        self.entries[key] = e
        return e

    def _capture(self, e: _Entry):
        """Warm up on the capture stream, then capture the body of this entry."""
        side = self.capture_stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(e)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=self.capture_stream):
            self._body(e)
        torch.cuda.synchronize()
        return g

    def n_batch_graphs(self) -> int:
        return sum(1 for k in self.entries if len(k) > 1)

    def _entry_for(self, key: tuple, x: torch.Tensor) -> _Entry | None:
        """The entry of this layout, capturing it when due; None: go frame by frame."""
        e = self.entries.get(key)
        if e is not None:
            return e
        if not self.use_graphs:                 # eager: fresh buffers, nothing kept
            return _Entry(layouts=key, x=torch.empty_like(x),
                          kv=kv_buffer(self.model, len(key)))
        if len(key) == 1:
            return self._new_entry(key, x)
        if self.n_batch_graphs() >= self.max_batch_graphs:
            return None
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] < 2:
            return None
        self.seen.pop(key, None)
        return self._new_entry(key, x)

    def _run(self, key: tuple, x: torch.Tensor) -> torch.Tensor | None:
        """kv [n_layers, 2, n, Hkv, P, D] of the frames (a view of the entry's static
        output: copy out before the next call), or None (not graphed yet)."""
        e = self._entry_for(key, x)
        if e is None:
            return None
        e.x.copy_(x)
        if e.graph is not None:
            e.graph.replay()
        else:
            self._body(e)
        return e.kv

    # -- encode ----------------------------------------------------------------------------
    def encode_batch(self, images: list, crops: str | None = None) -> list:
        """One EncodedImage per image, in order (EncodedImages given pass through)."""
        from ..models.moondream2.model import EncodedImage, _sync

        images = list(images)
        out = list(images)
        todo = [i for i, im in enumerate(images) if not isinstance(im, EncodedImage)]
        m = self.model
        for c in range(0, len(todo), self.max_frames):
            chunk = todo[c:c + self.max_frames]
            t0 = time.perf_counter()
            captured_before = self.capture_ms
            frames = []
            for i in chunk:
                image, mode = unwrap(images[i], crops, self.default_crops)
                array, x, tiling = m.image_crops(image, mode)
                frames.append((i, array, x, frame_layout(x, tiling, mode)))
            frames.sort(key=lambda f: _order(f[3]))                  # canonical order
            with torch.inference_mode():
                kvs = self._encode_frames(frames)
            _sync(m.weights.device)
            ms = (time.perf_counter() - t0) * 1e3
            setup = self.capture_ms - captured_before
            for (i, array, _, lay), k in zip(frames, kvs):
                out[i] = EncodedImage(kv=k, width=array.shape[1], height=array.shape[0],
                                      tiling=lay.tiling, crops=lay.crops,
                                      encode_ms=ms / len(frames),
                                      setup_ms=setup / len(frames), model_id=m.model_id)
        return out

    def _encode_frames(self, frames: list) -> list[torch.Tensor]:
        """frames [(index, array, crops, layout)] in canonical order -> k/v of each."""
        key = tuple(f[3] for f in frames)
        sizes = self._uniform_split(key)
        if sizes is not None:                  # k frames of one layout: captured sizes
            self.counts["split"] += 1
            out, off = [], 0
            for n in sizes:
                part = frames[off:off + n]
                off += n
                kv = self._run(key[:n], torch.cat([f[2] for f in part]))
                out += [kv[:, :, j:j + 1].clone() for j in range(n)]
            return out
        kv = self._run(key, torch.cat([f[2] for f in frames]))
        if kv is not None:
            self.counts["batched" if len(key) > 1 else "single"] += 1
            return [kv[:, :, j:j + 1].clone() for j in range(len(frames))]
        self.counts["frame_by_frame"] += 1     # through the single-frame graphs
        return [self._run((f[3],), f[2]).clone() for f in frames]

    def _uniform_split(self, key: tuple) -> list[int] | None:
        """For n frames of one layout with no graph of exactly n: the batch sizes of this
        layout's captured graphs that add up to n, largest first (7 -> 4 + 2 + 1), when at
        least one is a multi-frame graph; else None."""
        n = len(key)
        if not self.use_graphs or n < 2 or key in self.entries or len(set(key)) != 1:
            return None
        have = sorted((len(k) for k in self.entries if len(k) > 1 and k[0] == key[0]
                       and len(set(k)) == 1), reverse=True)
        sizes, left = [], n
        for m in have:
            while m <= left:
                sizes.append(m)
                left -= m
        sizes += [1] * left
        return sizes if sizes[0] > 1 else None

    def prepare(self, shapes=((480, 640),), batch_sizes=(1, 2, 4, 8),
                crops=("overlap",)) -> int:
        """Capture ahead the graphs of frames of these (height, width) shapes, crop modes and
        batch sizes (k cameras of one shape and mode), so that no capture (~0.3-1 s) falls
        into live traffic; multi-frame layouts count against max_batch_graphs (first come).
        Returns the graphs captured."""
        import numpy as np

        before = self.counts["captures"]
        if not self.use_graphs:
            return 0
        for h, w in shapes:
            img = np.zeros((h, w, 3), dtype=np.uint8)
            for mode in crops:
                _, x, tiling = self.model.image_crops(img, mode)
                lay = frame_layout(x, tiling, mode)
                for n in sorted(set(batch_sizes)):
                    n = min(n, self.max_frames)
                    key = (lay,) * n
                    if key in self.entries or (n > 1 and self.n_batch_graphs()
                                               >= self.max_batch_graphs):
                        continue
                    with torch.inference_mode():
                        self._new_entry(key, torch.cat([x] * n))
        return self.counts["captures"] - before

    def encode(self, image, crops: str | None = None):
        return self.encode_batch([image], crops)[0]

    def summary(self) -> dict:
        return {"graphs": len(self.entries), "batch_graphs": self.n_batch_graphs(),
                "capture_ms": round(self.capture_ms, 1), "fast": self.fast, **self.counts}


def _order(lay: FrameLayout) -> tuple:
    return (lay.crops, lay.tiling, lay.n_crops)


__all__ = ["GraphedBatchEncoder"]
