"""FastEngine: the GPU fast path behind the same engine API as the reference model, for any
model family that provides the runtime's plugin view (model.fast_family(): fast_family.py).

    from photon_core import load_model
    from photon_core.fast import FastEngine
    engine = FastEngine(load_model(path, device="cuda", dtype="bf16"))   # warms up + captures
    enc = engine.encode_image(frame)
    res = engine.run(enc, Task("detect", object="person"))
    runs = [engine.start(enc, t) for t in tasks]          # scheduler style
    while any(engine.step_batch(runs)): ...
    engine.metrics()   # GPU idle per step, step times, host launch/commit times, graphs

encode_image is the family's batched encoder (Moondream 2: graphed_batch_encoder.py) or its
reference encode as CUDA graphs (graphed_reference_encoder.py) or the reference model's
(vision + image-prefix prefill). start() prefills the prompt into a free row of the
state cache. step_batch() runs one pipelined step over the
given runs (pipelined_decoder.py). On the CPU the identical pipeline runs without graphs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch

from ..encode_request import unwrap
from ..engine import EngineOptions, PrefixState
from ..engine_conveniences import EngineConveniences
from ..task import Task, TaskResult
from .cuda_graph_runner import CudaGraphRunner
from .decode_step import StepState
from .detokenizer_thread import DetokenizerThread
from .fast_family import fast_family
from .fast_run import FastRun
from .gpu_idle import GpuIdleMeter
from .graphed_prefill import GraphedPrefill
from .pingpong_slots import PingPongSlots
from .pipelined_decoder import PipelinedDecoder
from .static_kv_cache import StaticKVCache
from .zombie_refcount import RowRefcount

DEFAULT_GPU_KV_CAPACITY = 1024

# Live engines of this process: a new engine's capture stream must differ from their streams.
_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _own_stream(device, taken: list) -> torch.cuda.Stream:
    """A stream that is none of `taken`. torch.cuda.Stream() hands out the streams of a fixed
    pool (32 per device and priority) round robin, so a fresh one can be one already in use;
    draw again (at most two turns of the pool) until it differs."""
    s = torch.cuda.Stream(device=device)
    for _ in range(64):
        if not any(s == t for t in taken):
            break
        s = torch.cuda.Stream(device=device)
    return s


# start() of an image copies the prefix k/v into the run's row straight from the encode
# graph's output (False: the encoded image's own copy first, as before session 30)
BORROW_ENCODE = True


class FastEngine(EngineConveniences):
    # encode_image / encode_batch take sync=False (the scheduler's queued encodes,
    # photon_core/scheduler/queued_encode.py)
    queued_encode = True

    def __init__(self, model, max_batch: int | None = None, kv_capacity: int | None = None,
                 use_graphs: bool | None = None, pipelined: bool = True,
                 detok_thread: bool = True, warmup: bool = True,
                 graphed_prefill: bool = True, graphed_encoder: bool | None = None,
                 deterministic: bool | None = None, options: EngineOptions | None = None,
                 **option_fields):
        """options: photon_core.engine.EngineOptions (backend, attention, deterministic,
        max_batch, kv_capacity); max_batch / kv_capacity / deterministic and any other
        EngineOptions field given as a keyword (fused="on", attention="sdpa") override it."""
        options = (options or EngineOptions()).with_(
            max_batch=max_batch, kv_capacity=kv_capacity, deterministic=deterministic,
            **option_fields)
        self.options = options
        max_batch, kv_capacity = options.max_batch, options.kv_capacity
        deterministic = options.deterministic
        self.model = model
        self.family = fam = fast_family(model)       # the family's runtime view
        # what the family serves (skills, crop modes): its reference engine's
        self.capabilities = model.capabilities
        dev = torch.device(fam.device)
        self.cuda = dev.type == "cuda"
        if kv_capacity is None:
            kv_capacity = min(fam.max_context, DEFAULT_GPU_KV_CAPACITY) if self.cuda \
                else fam.max_context
        # the state the family's step program declares (k/v rows, recurrent rows)
        self.kv = StaticKVCache.for_program(fam.spec.program, max_batch, kv_capacity, dev,
                                            fam.dtype)
        # deterministic: the same inputs give the same bits on every run (no split-K atomics
        # in the fused GEMVs; a few % slower per step, docs/benchmarks.md)
        self.deterministic = deterministic
        self.state = StepState(fam, max_batch, self.kv, options)
        self.use_graphs = self.cuda if use_graphs is None else use_graphs
        self.slots = PingPongSlots(max_batch, dev)
        self.runner = CudaGraphRunner(self.state, max_batch, self.use_graphs,
                                      [s.dev_out for s in self.slots.slots])
        self.prefill = GraphedPrefill(self.state, self.use_graphs) if graphed_prefill else None
        # default: graphs for the encoder where graphs are used; the CPU keeps the reference's
        if graphed_encoder is None:
            graphed_encoder = self.use_graphs
        self.fast_encode = options.encoder == "fast" or (options.encoder == "auto"
                                                         and self.cuda)
        # encoder "fast": a family's fast encode body where it has one (Gemma 4's vision
        # tower, models/gemma4/vision_fast.py)
        self.encoder = fam.make_encoder(self.use_graphs, fast=self.fast_encode) \
            if graphed_encoder else None
        # encode_batch (and encode_image unless encoder="reference"): the family's batched
        # encoder where it has one (Moondream 2: graphed_batch_encoder.py)
        self.batch_encoder = fam.make_batch_encoder(
            self.use_graphs and graphed_encoder, fast=self.fast_encode, max_frames=max_batch,
            default_crops=options.crops)
        if callable(getattr(fam, "crop_count", None)):
            self.crop_count = self._crop_count
        self.rows = RowRefcount(max_batch)
        self.idle = GpuIdleMeter(dev)
        self.detok = DetokenizerThread(threaded=detok_thread)
        others = [torch.cuda.graph.default_capture_stream] if self.cuda else []
        for e in list(_ENGINES):
            others += [e.stream, e.capture_stream]
        others = [t for t in others if t is not None]
        # the compute stream, like the capture stream below, differs from every live engine's
        self.stream = _own_stream(dev, others) if self.cuda else None
        # Every graph of this engine (decode pieces, prompt prefill, encoder) is captured on a
        # stream of its own, shared with no other engine. PyTorch keys the cuBLAS workspace by
        # (handle, stream) and a captured GEMM keeps the raw workspace address of its CAPTURE
        # stream: captured on torch.cuda.graph's one process-wide default stream, the graphs
        # of every engine would share one workspace, and two engines replaying at the same
        # time on their own compute streams corrupt each other's GEMMs (measured on the H200:
        # bench_kernels' back-to-back prefills in two engines, hidden states off by ~6 with
        # |h| <= 22). Freeing one graph can also free that workspace under other graphs
        # captured on the same stream (pytorch/pytorch#193402).
        # The warm-up runs before each capture use this stream too, so after construction the
        # engine draws no stream from torch's pool (32 per device, handed out round robin),
        # which could otherwise wrap around onto another engine's capture stream.
        self.capture_stream = None
        if self.use_graphs:
            self.capture_stream = _own_stream(dev, others + [self.stream])
            for part in (self.runner, self.prefill, self.encoder, self.batch_encoder):
                if part is not None:
                    part.capture_stream = self.capture_stream
        _ENGINES.add(self)
        self.decoder = PipelinedDecoder(self.state, self.runner, self.slots, self.rows,
                                        self.idle, pipelined=pipelined)
        if warmup and self.use_graphs:
            self.warmup()

    # -- engine API (photon_core.engine.Engine) ------------------------------------------
    @property
    def max_runs(self) -> int:
        """Runs open at once: one row of the state cache each."""
        return self.kv.rows

    @property
    def model_id(self) -> str:
        # the model's identity, not the engine's: results are the same model's either way
        return self.model.model_id

    @property
    def config(self):
        return self.model.config

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def stats(self):
        """The family's counters (e.g. grounding parse errors), where it keeps them."""
        return getattr(self.model, "stats", None)

    @property
    def pipelined(self) -> bool:
        return self.decoder.pipelined

    @pipelined.setter
    def pipelined(self, value: bool) -> None:
        self.decoder.drain()
        self.decoder.pipelined = value

    def warmup(self) -> None:
        """Capture the decode-step graphs for every batch bucket (GPU only)."""
        with self._compute_stream_ctx():
            self.runner.capture()
            if self.prefill is not None:
                self.prefill.capture()

    def encode_image(self, image, crops: str | None = None, sync: bool = True):
        """-> the family's encoded image. image: an image or an EncodeRequest (its crop mode);
        crops: "overlap" | "overlap:N" | "global" (None: the request's, else EngineOptions.crops).
        sync=False: with the batched encoder on CUDA, return once the encode is queued on
        the engine's stream (start() does this for an image: the task's prefill is queued
        behind it while the GPU still encodes; encode_ms is the host's time, the task's
        timings get the GPU's); sync=True (the scheduler's: it times the call) waits.
        With the family's batched encoder (Moondream 2) and encoder "fast" (default on CUDA):
        graphed_batch_encoder.py with one frame (the fused forms, one graph per layout);
        encoder "reference": the family's fast encoder (Moondream 2 on the GPU:
        graphed_reference_encoder.py, the reference's functions in one graph per tiling,
        bit-identical),
        else the reference model's encode_image."""
        if isinstance(image, PrefixState):
            return image
        image, mode = unwrap(image, crops, self.options.crops)
        if self._batch_encodes(mode):
            with self._compute_stream_ctx():
                return self.batch_encoder.encode(image, mode, sync)
        if mode != "overlap" and self.batch_encoder is None:
            raise ValueError(f"crops={mode!r}: this model family encodes whole images only "
                             "(crops='overlap')")
        if self.encoder is not None:
            with self._compute_stream_ctx():
                return self.encoder.encode(image, sync=sync)
        return self.family.encode_image(image, crops=mode) if self.batch_encoder is not None \
            else self.family.encode_image(image)

    def _batch_encodes(self, mode: str) -> bool:
        """Whether encode_image of crop mode `mode` goes through the family's batched
        encoder (graphed_batch_encoder.py)."""
        return self.batch_encoder is not None and (
            self.fast_encode or (mode != "overlap" and self.encoder is not None))

    def encode_batch(self, images, crops: str | None = None, sync: bool = True) -> list:
        """Several frames (images or EncodeRequests) in one vision pass and one batched
        image-prefix prefill: one encoded image each, in order, each usable like
        encode_image's (graphed_batch_encoder.py: one CUDA graph per frames' layout, a
        bounded number; the scheduler calls this for frames admitted together). A family
        without a batched encoder encodes them one by one. sync: as encode_image's."""
        if self.batch_encoder is None:
            return [self.encode_image(i, crops, sync) for i in images]
        with self._compute_stream_ctx():
            return self.batch_encoder.encode_batch(list(images), crops, sync)

    def _crop_count(self, height: int, width: int, crops: str | None = None) -> int:
        """Crops the encoder runs for a height x width frame in crop mode `crops` (None:
        EngineOptions.crops): the family's tiling rule (bound as `crop_count` only where
        the family has one; the scheduler's encode cost hint, scheduler/engine.py)."""
        return self.family.crop_count(height, width, crops or self.options.crops)

    def prepare_encode(self, shapes=((480, 640),), batch_sizes=(1, 2, 4, 8),
                       crops=("overlap",)) -> int:
        """Capture the encode graphs of frames of these shapes / crop modes / batch sizes now
        (graphed_batch_encoder.prepare), e.g. at activation; returns the graphs captured
        (0 for a family without a batched encoder)."""
        if self.batch_encoder is None:
            return 0
        with self._compute_stream_ctx():
            return self.batch_encoder.prepare(shapes, batch_sizes, crops)

    def count_prompt_tokens(self, task: Task) -> int:
        return self.family.count_prompt_tokens(task)

    def start(self, enc, task: Task, stream: Callable[[str], None] | None = None,
              ignore_eos: bool = False) -> FastRun:
        self.capabilities.check_skill(task.skill)   # the family's refusal, before any encode
        # an encoded image is returned as is; an image is encoded without a host wait (the
        # prefill goes on the same stream behind it), its k/v borrowed from the encode
        # graph's output: the run copies them into its row right away, on this stream, and
        # keeps no handle on them (its enc says how long the prefix was, no more)
        borrowed = False
        if BORROW_ENCODE and not isinstance(enc, PrefixState):
            image, mode = unwrap(enc, None, self.options.crops)
            borrowed = self._batch_encodes(mode)
        if borrowed:
            with self._compute_stream_ctx():
                enc = self.batch_encoder.encode(image, mode, sync=False, borrow=True)
        else:
            enc = self.encode_image(enc, sync=False)
        run = FastRun(self, enc, task, stream, ignore_eos)
        if borrowed:
            run.enc = dataclasses.replace(enc, kv=None, n_tokens=enc.length)
        return run

    def step_batch(self, runs) -> list[bool]:
        with self._compute_stream_ctx(), torch.inference_mode():
            return self.decoder.step_batch(list(runs))

    def drain(self) -> None:
        """Commit every launched step (zombies included); frees their rows."""
        with self._compute_stream_ctx(), torch.inference_mode():
            self.decoder.drain()

    def _after_run(self) -> None:
        """run() (EngineConveniences): commit the launched steps, zombies included."""
        self.drain()

    def run_batch(self, enc_tasks, ignore_eos: bool = False) -> list[TaskResult]:
        """Start every (enc, task) and decode them together until all finish."""
        runs = [self.start(e, t, ignore_eos=ignore_eos) for e, t in enc_tasks]
        while any(self.step_batch(runs)):
            pass
        self.drain()
        return [r.result() for r in runs]

    def metrics(self) -> dict:
        d = self.idle.summary()
        lm, cm = self.decoder.host_launch_ms, self.decoder.host_commit_ms
        d["host_launch_ms_mean"] = sum(lm) / len(lm) if lm else None
        d["host_commit_ms_mean"] = sum(cm) / len(cm) if cm else None
        d["graphs"] = len(self.runner.graphs) + (len(self.prefill.graphs) if self.prefill else 0)
        d["graph_capture_ms"] = self.runner.capture_ms
        if self.prefill is not None and self.prefill.capture_errors:
            d["prefill_capture_errors"] = dict(self.prefill.capture_errors)
        if getattr(self.encoder, "capture_errors", None):
            d["encoder_capture_errors"] = {str(k): v for k, v in
                                           self.encoder.capture_errors.items()}
        if getattr(self.encoder, "eager_encodes", 0):
            d["encoder_eager_encodes"] = self.encoder.eager_encodes
        d["kv_capacity"] = self.kv.capacity
        d["pipelined"] = self.decoder.pipelined
        d["deterministic"] = self.deterministic
        if self.options.megakernel != "off":
            mk = self.state.megakernel
            d["megakernel"] = str(mk.variant) if mk is not None else None
            d["megakernel_fallback"] = self.state.megakernel_fallback
        if self.batch_encoder is not None:
            d["encoder"] = self.batch_encoder.summary()
        return d

    def fallbacks(self) -> dict:
        """Where the engine runs slower than it could, for a node's diagnostics (cheap reads,
        safe from another thread): encode layouts / prompt buckets whose graph capture failed,
        frames encoded without a graph (more layouts than the encoder keeps graphs for), and
        why the megakernel does not serve this model ("" where it does or is off)."""
        enc = self.encoder
        return {"encoder_capture_errors": len(getattr(enc, "capture_errors", None) or {}),
                "prefill_capture_errors": len(self.prefill.capture_errors)
                if self.prefill is not None else 0,
                "encoder_eager_encodes": getattr(enc, "eager_encodes", 0),
                "megakernel_fallback": self.state.megakernel_fallback or ""}

    def reset_metrics(self) -> None:
        self.idle.reset()
        self.decoder.host_launch_ms.clear()
        self.decoder.host_commit_ms.clear()

    def close(self) -> None:
        self.drain()
        self.detok.close()

    # -- internals used by FastRun ------------------------------------------------------
    def _compute_stream_ctx(self):
        return torch.cuda.stream(self.stream) if self.stream is not None \
            else contextlib.nullcontext()

    def _acquire_row(self, run) -> int:
        row = self.rows.acquire(run)
        if row is None:          # rows held by zombies of launched steps: commit them
            self.drain()
            row = self.rows.acquire(run)
        if row is None:
            raise RuntimeError(f"all {self.rows.refs.__len__()} fast-path batch slots are "
                               "busy; finish or cancel a run first")
        return row

    def _started(self, run) -> None:
        self.decoder.break_chain()

    def _run_finished(self, run) -> None:
        if run.row is not None:
            self.rows.finished(run.row)
