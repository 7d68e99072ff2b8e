"""The runtime (GPU fast path; see docs/architecture.md, "Fast path" and "Model families,
step programs, backends").

Model-agnostic: a family plugs in through fast_family.py (FastFamily: its step program,
prefix state, prompts, the host side of its skill protocol). One mechanism per file:
fast_family (the plugin boundary), static_kv_cache (state rows), state_ops (the hybrid
stateful ops bound to the state cache), decode_step (the batched step as
graph-capturable pieces), eager_backend / fused_backend (execute a family's step program:
the ops' torch references / the Triton kernels), cuda_graph_runner, graphed_prefill,
graphed_reference_encoder, graphed_batch_encoder, pingpong_slots, zombie_refcount,
pipelined_decoder, fast_run, detokenizer_thread, gpu_idle, fast_engine. Importing this package imports torch.
"""
from .fast_engine import FastEngine
from .fast_run import FastRun

__all__ = ["FastEngine", "FastRun"]
