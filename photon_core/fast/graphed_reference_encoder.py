"""encode_image of a family without an encoder of its own (Qwen 3.5, Gemma 4) as one CUDA graph
per input layout: the reference's own encode, replayed.

The reference encode (vision tower, then the image prefix through the reference decoder) is
in large part host-bound: thousands of small kernels per frame (bench/probe_family_encode.py).
The model splits its encode_image in three (photon_core/split_encode.py: encode_inputs on the
host with a layout key, encode_body on the device only, encode_result). Here each new key runs
the body once eagerly (warm-up, on the capture stream), then captures it; a later frame copies
its tensors into that key's static inputs and replays. Inside the graph are exactly the
reference's calls, so the result is the reference encode's, bit for bit
(test/core/test_qwen3_5_fast_gpu.py, test_gemma4_fast_gpu.py) - unless a fast body is given
(FastEngine encoder "fast": the model's encode_body_fast, e.g. Gemma 4's fast vision tower:
close to the reference, not bitwise). use_graphs=False: the body runs eagerly (the CPU); so
does a layout whose capture fails (capture_errors says why, and
FastEngine.metrics()["encoder_capture_errors"]). At most MAX_LAYOUTS layouts get a graph (each
holds its own static inputs and outputs in GPU memory): frames of a further layout run the body
eagerly (the same result, slower), counted in `eager_encodes` (FastEngine.metrics()
["encoder_eager_encodes"]), so a stream of ever-new frame sizes cannot grow GPU memory.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import GpuTiming
from ..split_encode import EncodeInputs
from .. import weight_layout
from .cuda_graph_runner import capture_graph, warm_up

log = logging.getLogger(__name__)

MAX_LAYOUTS = 8       # graphs kept (frame sizes x prefix lengths); later layouts run eagerly

@dataclass
class _Entry:
    inputs: EncodeInputs                    # static inputs (the tensors the graph reads)
    state: Any = None                       # static output of the body
    graph: Any = None
    # the tensors the static inputs were cloned from: a model's per-layout tensors (kept by
    # the model, the same objects every frame) need no copy into the graph's inputs
    sources: dict = None


class GraphedReferenceEncoder:
    def __init__(self, model, use_graphs: bool, body=None):
        self.model = model
        self.use_graphs = use_graphs
        self.body = body or model.encode_body      # inputs -> state, device work only
        self.entries: dict[tuple, _Entry] = {}
        self.capture_ms = 0.0
        self.capture_stream = None   # set by FastEngine: its own stream (fast_engine.py)
        self.capture_errors: dict[tuple, str] = {}   # layout -> why it runs eagerly
        self.eager_encodes = 0       # frames of a layout past MAX_LAYOUTS, run without a graph

    def _entry(self, inp: EncodeInputs) -> _Entry:
        e = self.entries.get(inp.key)
        if e is not None:
            return e
        static = EncodeInputs(inp.key, {k: t.clone() for k, t in inp.tensors.items()},
                              inp.info, inp.t0)
        e = _Entry(static, sources=dict(inp.tensors))
        if self.use_graphs:
            t0 = time.perf_counter()
            warm_up(lambda: self.body(static), self.capture_stream)
            try:
                e.graph, e.state = capture_graph(lambda: self.body(static),
                                                 self.capture_stream)
                # the graph reads the model's weights by address: none may be swapped for a
                # view of a joined copy from now on (weight_layout.held)
                weight_layout.hold(getattr(self.model, "weights", {}))
            except RuntimeError as exc:
                # a body that cannot be captured (an op that syncs with the host) runs
                # eagerly for this layout - slower, the same result - and says why
                e.state = None
                self.capture_errors[inp.key] = str(exc).splitlines()[0] if str(exc) \
                    else repr(exc)
                log.warning("encode graph for layout %s not captured, runs eagerly: %s",
                            inp.key, self.capture_errors[inp.key])
            self.capture_ms += (time.perf_counter() - t0) * 1e3
        self.entries[inp.key] = e
        return e

    def encode(self, image, sync: bool = True):
        """sync=False (a captured layout): return once the replay is queued on the current
        stream (no host wait: the task's prefill is queued behind it while the GPU encodes);
        the encoding then carries gpu_timing (CUDA events around the replay)."""
        m = self.model
        if m.is_encoded(image):
            return image
        inp = m.encode_inputs(image)
        with torch.inference_mode():
            if inp.key not in self.entries and len(self.entries) >= MAX_LAYOUTS:
                self.eager_encodes += 1
                return m.encode_result(self.body(inp), inp, copy=False)
            captured_before = self.capture_ms
            e = self._entry(inp)                      # captures a graph for a new layout
            setup_ms = self.capture_ms - captured_before
            if e.graph is None:
                return m.encode_result(self.body(inp), inp, copy=False)
            start = None if sync else GpuTiming.start_event()
            for k, t in inp.tensors.items():
                if t is not e.sources[k]:
                    e.inputs.tensors[k].copy_(t)
            e.graph.replay()
            enc = m.encode_result(e.state, inp, copy=True, setup_ms=setup_ms,
                                  gpu_timing=None if sync else GpuTiming.timing(start))
        return enc
