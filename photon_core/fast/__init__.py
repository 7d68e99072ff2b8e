"""GPU fast path for Moondream 2 (see docs/architecture.md, "Fast path").

One mechanism per file: static_kv_cache, decode_step (the batched step as graph-capturable
pieces), cuda_graph_runner, graphed_prefill, graphed_encoder, pingpong_slots,
zombie_refcount, pipelined_decoder, fast_run, detokenizer_thread, gpu_idle, fast_engine.
Importing this package imports torch.
"""
from .fast_engine import FastEngine
from .fast_run import FastRun

__all__ = ["FastEngine", "FastRun"]
