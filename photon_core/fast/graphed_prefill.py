"""The task prompt's prefill as CUDA graphs, one per prompt-length bucket (8 .. 128 tokens).

The eager prefill (the reference decoder over a handful of prompt tokens) is bound by kernel
launches (~600 of them, ~19 ms on the H200 for 8 tokens). Here the prompt is padded to its
bucket and run through a static-shape decoder over the row of the static KV cache:

  inputs (one device tensor, filled by ONE pinned async copy): row, start (= the image prefix
  length), real length, rotary position offset (PrefixState.position_offset), token ids
  padded with 0.
  positions start .. start+T-1; causal mask over the whole capacity (key <= query position);
  k/v written at (row, position); the hidden state of the last REAL token is the output.

Padding tokens sit after the real ones, so causality keeps them out of every real token's
result; their k/v land on positions that decode steps overwrite before anyone reads them;
recurrent row states (hybrid programs) take only the real tokens (the backends' n_valid).
Prompts longer than the largest bucket use the eager reference prefill. On the CPU the same
code runs eagerly (tests compare it with the reference).

The prompt's ids become the program's inputs through the family's feedback (embed_ids: the
token embedding, or Gemma's scaled one with its per-layer token part); the positions reach
the attention ops as device tensors (start + i). The prefill runs the family's step program (program.py) over the T token rows of one row:
with the fused backend (the default on CUDA in bf16/fp16) for buckets of up to FUSED_MAX_T (16)
tokens - its norm and GEMV kernels over the token rows (the weights streamed once per layer
at GEMV speed instead of cuBLAS's small-M GEMMs and ~10 more launches per layer), the
attention op's torch prefill form - else with the eager backend (the ops' torch references).
"""
from __future__ import annotations

import torch

from ..ops import GEMV_MAX_ROWS
from . import state_ops
from .cuda_graph_runner import capture_graph, warm_up
from .eager_backend import embed_ids

BUCKETS = (8, 16, 32, 64, 128)
FUSED_MAX_T = GEMV_MAX_ROWS   # prompt tokens the fused GEMV takes in one pass


class GraphedPrefill:
    def __init__(self, state, use_graphs: bool):
        self.state = st = state
        self.use_graphs = use_graphs
        cap = st.kv.capacity
        self.buckets = tuple(b for b in BUCKETS if b < cap)
        tmax = self.buckets[-1]
        dev = st.hidden.device
        self.meta = torch.zeros(4 + tmax, dtype=torch.long, device=dev)
        self.hidden_out = torch.zeros(st.program.dim, device=dev, dtype=st.hidden.dtype)
        self.token_ids = torch.arange(tmax, device=dev)
        self.feedback = st.eager.feedback     # ids -> the program's inputs (embed_ids)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # None: the eager backend for every bucket; else the fused backend (its buffers are
        # free between decode steps, all on one stream) for buckets <= FUSED_MAX_T
        self.fused = st.fused
        self.capture_stream = None   # set by FastEngine: its own stream (fast_engine.py)
        self.hybrid = state_ops.uses_state_ops(st.program)
        self.capture_errors: dict[int, str] = {}   # bucket -> why it runs eagerly (hybrid)

    def bucket(self, length: int) -> int | None:
        for b in self.buckets:
            if b >= length:
                return b
        return None

    def _run(self, T: int) -> None:
        row, start, length = self.meta[0:1], self.meta[1:2], self.meta[2:3]
        offset = self.meta[3:4]
        inputs = embed_ids(self.feedback, self.meta[4:4 + T])           # x [T, dim], ...
        pos = start + self.token_ids[:T]
        backend = self.fused if self.fused is not None and T <= FUSED_MAX_T \
            else self.state.eager
        last = backend.prefill(inputs.pop("x"), row, pos, offset, length, extra=inputs)
        self.hidden_out.copy_(last.index_select(0, length - 1)[0])

    def capture(self) -> None:
        """Capture every bucket (at engine warm-up, before any row is in use: the capture
        runs write k/v of row 0)."""
        if not self.use_graphs or self.graphs:
            return
        self.meta.zero_()
        self.meta[2] = 1
        with torch.inference_mode():
            warm_up(lambda: [self._run(T) for _ in range(2) for T in self.buckets],
                    self.capture_stream)
            pool = torch.cuda.graph_pool_handle()
            for T in self.buckets:
                try:
                    g = capture_graph(lambda: self._run(T), self.capture_stream, pool)[0]
                except RuntimeError as e:
                    # a hybrid program's prefill (the chunked delta rule's triangular
                    # solve) may not be capturable: that bucket runs eagerly, said here
                    if not self.hybrid:
                        raise
                    self.capture_errors[T] = str(e).splitlines()[0] if str(e) else repr(e)
                    continue
                self.graphs[T] = g
        torch.cuda.synchronize()

    def run(self, row: int, start: int, prompt: list[int], offset: int = 0) -> torch.Tensor:
        """Prefill `prompt` at positions start.. of `row` (rotary positions + offset); returns
        the last hidden state (a static buffer: copy it before the next prefill)."""
        T = self.bucket(len(prompt))
        meta = torch.tensor([row, start, len(prompt), offset] + list(prompt), dtype=torch.long)
        if self.meta.is_cuda:
            meta = meta.pin_memory()
        self.meta[:meta.numel()].copy_(meta, non_blocking=True)
        g = self.graphs.get(T)
        if g is not None:
            g.replay()
        else:
            self._run(T)
        return self.hidden_out
