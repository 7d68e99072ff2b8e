"""encode_batch for the runtime: several frames' crops in one vision pass and one batched
image-prefix prefill (models/moondream2/batched_encode.encode_body), as one CUDA graph per
frames' layout, with a bounded number of graphs.

Layout of a batch: the frames' (crop mode, tiling, crop count, and with the crops in the
graph the frame size), sorted (frames are encoded in that canonical order and handed back
in the caller's, so cameras A, B and B, A share one graph). A 640x480 camera always has the
same layout, so k cameras of one resolution need one graph per batch size.

Graphs: a single-frame layout is captured the first time it is seen (as
graphed_reference_encoder.py does per tiling). n frames of one layout with graphs of that layout at other batch sizes run
as those (7 -> 4 + 2 + 1; `prepare` captures sizes 1, 2, 4, 8 ahead). Otherwise a
multi-frame layout is captured the second time it is seen (a one-off mix of cameras is not
worth a ~0.3-1 s capture); until then, and for any layout once `max_batch_graphs`
multi-frame graphs exist, the batch is encoded frame by frame through the single-frame
graphs (correct, the speed of one-at-a-time). Graphs are never evicted:
freeing a graph can free the cuBLAS workspace under other graphs captured on the same
stream (pytorch/pytorch#193402, fast_engine.py), so the bound is on captures. Batches larger
than `max_frames` are encoded in chunks.

Crops inside the graph (crops_in_graph; default on where graphs are used on CUDA and
model.crops_on_device is not False): the layout of a frame then also holds its (height,
width) (FrameLayout.size), and the graph starts from one static uint8 [H, W, 3] device
buffer per frame: the frame goes in through a pinned host buffer with non_blocking (no host
sync), and the graph computes the crops (crops.CropPlan: the same torch ops as
model.image_crops, its LANCZOS tables put on the device when the entry is made, outside the
capture), their normalisation, the vision encoder and the prefix prefill: the same bits as
the crops made outside, without the crops' many small eager launches. Without it (CPU,
crops_on_device=False, graphs off) model.image_crops makes the crops eagerly and they are
copied into the graph's static input (layouts without a size). The crops of a frame size
need graphs of their own (a layout per size, not per tiling), so at most `max_frame_sizes`
distinct (height, width) get in-graph crops; a batch with a frame of any other size is
encoded with the crops made outside (counts["crops_outside"]), through the per-tiling graphs.

fast=True runs the faster equivalent forms (vision_fused.py, prefix_prefill's fast form:
close to the reference, not bitwise); fast=False the reference's functions (on the CPU each
frame bit-identical to encode_image; on CUDA the batched GEMMs may round differently).
On the CPU (no graphs) the same body runs eagerly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import weight_layout
from ..encode_request import unwrap
from ..engine import GpuTiming
from .cuda_graph_runner import capture_graph, capture_graph_parts, warm_up
from ..models.moondream2.batched_encode import (FrameLayout, encode_body, frame_layout,
                                                 kv_buffer, pixel_layout)
from ..models.moondream2 import vision_fused
from ..models.moondream2.image_input import to_rgb_array


@dataclass
class _Entry:
    layouts: tuple[FrameLayout, ...]
    # the frames' normalized crops, concatenated: the static input, or (crops in the graph)
    # written by the body from `frames`
    x: torch.Tensor
    kv: torch.Tensor           # static output [n_layers, 2, n, Hkv, P, D]
    graph: object = None
    # crops in the graph (layouts with a size): per frame the static uint8 [H, W, 3] buffer
    # on the model's device, its crops.CropPlan, its pinned host staging buffer (CUDA)
    frames: list | None = None
    plans: list | None = None
    staging: list | None = None
    copied: object = None      # CUDA event: the last copy-in has read the staging buffers


class GraphedBatchEncoder:
    def __init__(self, model, use_graphs: bool, fast: bool = False, max_batch_graphs: int = 4,
                 max_frames: int = 8, default_crops: str = "overlap",
                 crops_in_graph: bool | None = None, max_frame_sizes: int = 8):
        self.model = model
        self.use_graphs = use_graphs
        if crops_in_graph is None:
            crops_in_graph = (use_graphs and model.weights.device.type == "cuda"
                              and getattr(model, "crops_on_device", None) is not False)
        # the frames' crops inside the graph (see the module doc); may be switched between
        # calls (the layouts of either kind keep their graphs)
        self.crops_in_graph = bool(crops_in_graph)
        self.max_frame_sizes = max_frame_sizes
        self.frame_sizes: set[tuple[int, int]] = set()    # admitted to in-graph crops
        self.fast = fast
        self.max_batch_graphs = max_batch_graphs
        self.max_frames = max(1, max_frames)
        self.default_crops = default_crops
        self.entries: dict[tuple, _Entry] = {}
        self.seen: dict[tuple, int] = {}        # multi-frame layouts seen, not captured
        self.capture_ms = 0.0
        self.capture_stream = None              # set by FastEngine (its own stream)
        # calls: one frame / several in one graph / split over captured sizes / one by one;
        # batches whose crops were made outside the graph although crops_in_graph is on
        self.counts = {"single": 0, "batched": 0, "split": 0, "frame_by_frame": 0,
                       "captures": 0, "crops_outside": 0}

    # -- graphs ----------------------------------------------------------------------------
    def _body(self, e: _Entry, cut=None) -> None:
        if e.frames is not None:            # the crops, as model.image_crops makes them
            off = 0
            for frame, plan in zip(e.frames, e.plans):
                self.model.device_crops(frame, plan, out=e.x[off:off + plan.n_crops])
                off += plan.n_crops
        encode_body(self.model, e.x, list(e.layouts), e.kv, fast=self.fast, cut=cut)

    def _make_entry(self, key: tuple, part: list) -> _Entry:
        """A new entry's buffers, its inputs loaded from part [(index, array, crops, layout)]
        (not captured)."""
        m = self.model
        kv = kv_buffer(m, len(key))
        if key[0].size is None:             # crops made outside: a static crops input
            return _Entry(layouts=key, x=torch.empty_like(torch.cat([f[2] for f in part])),
                          kv=kv)
        dev = m.weights.device
        cuda = dev.type == "cuda"
        e = _Entry(layouts=key, x=None, kv=kv,
                   frames=[torch.empty((*lay.size, 3), dtype=torch.uint8, device=dev)
                           for lay in key],
                   plans=[m.crop_plan(*lay.size, lay.crops) for lay in key],
                   staging=[torch.empty((*lay.size, 3), dtype=torch.uint8, pin_memory=True)
                            for lay in key] if cuda else None,
                   copied=torch.cuda.Event() if cuda else None)
        self._load(e, part)
        # the static crops: laid out as the concatenated crops of image_crops are
        e.x = torch.cat([m.device_crops(f, p) for f, p in zip(e.frames, e.plans)])
        return e

    def _load(self, e: _Entry, part: list) -> None:
        """Copy the frames' inputs in: their crops into x, or (crops in the graph) their
        pixels into the frame buffers, on CUDA through the pinned staging buffers with
        non_blocking (no host sync, no pageable copy)."""
        if e.frames is None:
            off = 0
            for f in part:
                n = f[2].shape[0]
                e.x[off:off + n].copy_(f[2])
                off += n
        elif e.staging is None:
            for buf, f in zip(e.frames, part):
                np.copyto(buf.numpy(), f[1])
        else:
            e.copied.synchronize()          # the previous copy-in is done with the staging
            for buf, st, f in zip(e.frames, e.staging, part):
                np.copyto(st.numpy(), f[1])
                buf.copy_(st, non_blocking=True)
            e.copied.record()

    def _new_entry(self, key: tuple, part: list) -> _Entry:
        t0 = time.perf_counter()
        e = self._make_entry(key, part)
        if e.frames is None:
            self._load(e, part)
        e.graph = self._capture(e)
        self.capture_ms += (time.perf_counter() - t0) * 1e3
        self.counts["captures"] += 1
        self.entries[key] = e
        return e

    def _capture(self, e: _Entry):
        """Warm up on the capture stream, then capture the body of this entry: as two
        graphs where the fast vision encoder cuts it (vision_fused.CUT_AFTER_BLOCK), the
        first short, so the GPU starts while the host launches the second."""
        warm_up(lambda: self._body(e), self.capture_stream)
        if self.fast and vision_fused.CUT_AFTER_BLOCK is not None:
            g = capture_graph_parts(lambda cut: self._body(e, cut), self.capture_stream)[0]
        else:
            g = capture_graph(lambda: self._body(e), self.capture_stream)[0]
        # the graph reads the model's weights by address: none may be swapped for a view of
        # a joined copy from now on (weight_layout.held)
        weight_layout.hold(self.model.weights)
        return g

    def n_batch_graphs(self) -> int:
        return sum(1 for k in self.entries if len(k) > 1)

    def _admit(self, sizes) -> bool:
        """Whether frames of these (height, width) get their crops in the graph: yes when
        every size is admitted already or there is room for the new ones (graphs off:
        always, nothing is kept)."""
        new = set(sizes) - self.frame_sizes
        if not new or not self.use_graphs:
            return True
        if len(self.frame_sizes) + len(new) > self.max_frame_sizes:
            return False
        self.frame_sizes |= new
        return True

    def _entry_for(self, key: tuple, part: list) -> tuple[_Entry | None, bool]:
        """(the entry of this layout, capturing it when due; None: go frame by frame,
        whether its inputs are loaded already)."""
        e = self.entries.get(key)
        if e is not None:
            return e, False
        if not self.use_graphs:                 # eager: fresh buffers, nothing kept
            return self._make_entry(key, part), key[0].size is not None
        if len(key) == 1:
            return self._new_entry(key, part), True
        if self.n_batch_graphs() >= self.max_batch_graphs:
            return None, False
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] < 2:
            return None, False
        self.seen.pop(key, None)
        return self._new_entry(key, part), True

    def _run(self, key: tuple, part: list) -> torch.Tensor | None:
        """kv [n_layers, 2, n, Hkv, P, D] of the frames part [(index, array, crops,
        layout)] (a view of the entry's static output: copy out before the next call), or
        None (not graphed yet)."""
        e, loaded = self._entry_for(key, part)
        if e is None:
            return None
        if not loaded:
            self._load(e, part)
        if e.graph is not None:
            e.graph.replay()
        else:
            self._body(e)
        return e.kv

    # -- encode ----------------------------------------------------------------------------
    def encode_batch(self, images: list, crops: str | None = None, sync: bool = True,
                     borrow: bool = False) -> list:
        """One EncodedImage per image, in order (EncodedImages given pass through).
        sync=False (CUDA): return once the encode is queued on the current stream (work
        queued after it on that stream sees its k/v: a task's prefill follows without the
        GPU idling while the host prepares it); encode_ms is then the host's time and
        EncodedImage.gpu_encode_ms() the GPU's (CUDA events around the call).
        borrow: a graphed layout's k/v are views of its graph's output, not copies (one
        pass over the prefix's k/v less: 137 MB for Moondream 2), valid only until the
        next encode of that layout is queued - for a caller that copies them out on this
        stream before anything else runs (FastEngine.start of an image)."""
        from ..models.moondream2.model import EncodedImage

        images = list(images)
        out = list(images)
        todo = [i for i, im in enumerate(images) if not isinstance(im, EncodedImage)]
        m = self.model
        in_graph = self.crops_in_graph
        for c in range(0, len(todo), self.max_frames):
            chunk = todo[c:c + self.max_frames]
            t0 = time.perf_counter()
            captured_before = self.capture_ms
            cuda = m.weights.device.type == "cuda"
            start = GpuTiming.start_event() if cuda and not sync else None
            timing = None
            frames = []                 # (index, array, crops or None, layout)
            if in_graph:                # the pixels go in; the graph makes the crops
                for i in chunk:
                    image, mode = unwrap(images[i], crops, self.default_crops)
                    array = to_rgb_array(image, m.max_image_side)
                    frames.append((i, array, None,
                                   pixel_layout(m, array.shape[0], array.shape[1], mode)))
                if not self._admit(f[3].size for f in frames):     # too many frame sizes
                    self.counts["crops_outside"] += 1
                    frames = [(i, array, *self._crops_outside(array, lay.crops))
                              for i, array, _, lay in frames]
            else:
                for i in chunk:
                    image, mode = unwrap(images[i], crops, self.default_crops)
                    array, x, tiling = m.image_crops(image, mode)
                    frames.append((i, array, x, frame_layout(x, tiling, mode)))
            frames.sort(key=lambda f: _order(f[3]))                  # canonical order
            with torch.inference_mode():
                kvs = self._encode_frames(frames, borrow)
            # sync: the k/v are ready and encode_ms is their time: this stream's work only
            # (the encode's), not the whole device's (other engines' streams)
            if start is not None:
                timing = GpuTiming.timing(start, 1.0 / len(frames))
            elif cuda:
                torch.cuda.current_stream(m.weights.device).synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            setup = self.capture_ms - captured_before
            for (i, array, _, lay), k in zip(frames, kvs):
                out[i] = EncodedImage(kv=k, width=array.shape[1], height=array.shape[0],
                                      tiling=lay.tiling, crops=lay.crops,
                                      encode_ms=ms / len(frames),
                                      setup_ms=setup / len(frames), model_id=m.model_id,
                                      gpu_timing=timing)
        return out

    def _crops_outside(self, array: np.ndarray, mode: str) -> tuple:
        """(crops, layout) of a frame whose crops are made outside the graph."""
        _, x, tiling = self.model.image_crops(array, mode)
        return x, frame_layout(x, tiling, mode)

    def _encode_frames(self, frames: list, borrow: bool = False) -> list[torch.Tensor]:
        """frames [(index, array, crops, layout)] in canonical order -> k/v of each
        (borrow: views of a graph's output where one layout's graph ran them all)."""
        key = tuple(f[3] for f in frames)
        sizes = self._uniform_split(key)
        if sizes is not None:                  # k frames of one layout: captured sizes
            self.counts["split"] += 1
            out, off = [], 0
            for n in sizes:
                part = frames[off:off + n]
                off += n
                kv = self._run(key[:n], part)
                out += [kv[:, :, j:j + 1].clone() for j in range(n)]
            return out
        kv = self._run(key, frames)
        if kv is not None:
            self.counts["batched" if len(key) > 1 else "single"] += 1
            return [kv[:, :, j:j + 1] if borrow else kv[:, :, j:j + 1].clone()
                    for j in range(len(frames))]
        self.counts["frame_by_frame"] += 1     # through the single-frame graphs
        return [self._run((f[3],), [f]).clone() for f in frames]

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
        Layouts of the current crops_in_graph kind. Returns the graphs captured."""
        before = self.counts["captures"]
        if not self.use_graphs:
            return 0
        for h, w in shapes:
            img = np.zeros((h, w, 3), dtype=np.uint8)
            for mode in crops:
                if self.crops_in_graph and self._admit([(h, w)]):
                    x, lay = None, pixel_layout(self.model, h, w, mode)
                else:
                    x, lay = self._crops_outside(img, mode)
                for n in sorted(set(batch_sizes)):
                    n = min(n, self.max_frames)
                    key = (lay,) * n
                    if key in self.entries or (n > 1 and self.n_batch_graphs()
                                               >= self.max_batch_graphs):
                        continue
                    with torch.inference_mode():
                        self._new_entry(key, [(None, img, x, lay)] * n)
        return self.counts["captures"] - before

    def encode(self, image, crops: str | None = None, sync: bool = True,
               borrow: bool = False):
        return self.encode_batch([image], crops, sync, borrow)[0]

    def summary(self) -> dict:
        return {"graphs": len(self.entries), "batch_graphs": self.n_batch_graphs(),
                "capture_ms": round(self.capture_ms, 1), "fast": self.fast,
                "crops_in_graph": self.crops_in_graph, **self.counts}


def _order(lay: FrameLayout) -> tuple:
    return (lay.crops, lay.tiling, lay.n_crops, lay.size or (0, 0))


__all__ = ["GraphedBatchEncoder"]
