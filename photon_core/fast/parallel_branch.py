"""A step program's independent branch on a second CUDA stream, for the fused backend: a
fork and a join inside the step's graph, so two chains of kernels run at once.

Where: a `linear` whose outputs are plain segments then ONE gelu segment (Moondream 2's
`h -> [qkv | gelu(fc1)]`, one joined GEMV otherwise), followed by the ops that read only the
plain part (its `attention`) before the op that reads the gelu part (the block's
`residual`). Phi's parallel block computes attention and the MLP from the same LayerNorm
output, so the fc1 GEMV (33.5 MB of weights per layer at Moondream 2's shapes) has no reason
to wait for the attention:

    main:  LN -> GEMV qkv -> attention (rotary, k/v write, attention, combine) -> join -> residual
    side:                +-> GEMV fc1 + GELU ------------------------------/

fc1 forks after the qkv GEMV, not beside it: two GEMVs at once share the bandwidth and both
end when the joined one would (session 34 call 2: qkv and fc1 side by side 16.0 / 16.3 us,
the joined GEMV 16.4 us; attention started no earlier). So the qkv GEMV runs alone at the
full rate, and the attention chain - latency-bound: 4.1 + 1.3 us at b=1 for ~1 MB of k/v at
position 300 - runs while fc1 streams its weights. Each part takes gemv.pick's tiles for its
own width (the qkv part with the joined GEMV's 64-row tiles is 96 programs: 11-12 us alone);
with SAME_TILES, and in deterministic mode (EngineOptions.deterministic: its bits stay those
of the joined GEMV, which other paths are compared with), the joined GEMV's tiles on row
slices of its weights: every output keeps its sums, the same bits (test_parallel_branch.py).
Passes of more than MAX_ROWS rows run the joined GEMV and the attention in order.

MODE (module switch, bench/ab_switch.py's --toggle): "side" (the fork above) or "off" (the
joined GEMV, then the attention chain: the A/B baseline). The attention chain on a
high-priority stream instead lost (0.75-0.81x: fc1 waited for the chain's programs; docs/
dropped_experiments.md). On the CPU the same lowering runs its parts in order on the one
stream (StreamFork).
"""
from __future__ import annotations

import torch

from ..ops.gemv import EPI_QKV_GELU, EPI_STORE, gemv, pick

MODE = "side"                       # "side" | "off"
# the two GEMVs with the joined GEMV's tiles (the same bits as it) or gemv.pick's for each
# part's own width (more programs: the qkv part alone has 96 of the joined config's 64 rows)
SAME_TILES = False
# passes of at most MAX_ROWS rows fork (decode buckets; prompt prefills are 8+ tokens). H200,
# fused steps against one stream (bench/ab_switch.py, session 34 calls 4, 7, 8): b=1 / 2 / 4 /
# 8 at position 300 1.06x / 1.03x / 1.02x / 1.00x, at 760 1.05-1.06x / 1.02x / 0.99-1.01x /
# 0.96x (at 8 rows the attention reads ~50 MB of k/v per layer and both branches slow
# down); the prompt prefill forked, T = 8: 1.266 vs 1.175 ms (call 8)
MAX_ROWS = 2
# op kinds that may run in the branch beside the gelu part (each lowered on its own)
BETWEEN = ("attention",)


class StreamFork:
    """fork(): the branch stream waits for the caller's stream's work so far; join(): the
    caller's stream waits for the branch's. Under graph capture both become graph edges.
    On the CPU there is one stream: fork() gives None (torch.cuda.stream(None) does
    nothing) and the branch runs in program order - the same ops, the same bits."""

    def __init__(self, device):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def fork(self):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return self.stream

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def _conflicts(op, reads: tuple, writes: tuple) -> bool:
    """op touches what the branch beside it reads (writes it) or writes (reads or writes it)."""
    return any(s in writes for s in op.src) or any(s in writes or s in reads for s in op.dst)


def lower_beside(be, ops, i: int, joined):
    """ops[i] (a linear the backend `be` lowered as one joined [plain | gelu] GEMV: its
    be.fused_gemvs entry) and the ops after it that only read the plain part, as runs
    fn(b, env) with the gelu part on the other stream: (runs, ops consumed), or None where
    the pattern does not apply (then the caller keeps the joined GEMV). joined: the joined
    GEMV's run, which passes of more than MAX_ROWS rows take (then the ops after it in
    order, on one stream)."""
    op = ops[i]
    fg = be.fused_gemvs.get(op)             # (the joined GEMV, lowered already)
    if MODE == "off" or op.kind != "linear" or fg is None:
        return None
    if fg["epi"] != EPI_QKV_GELU or fg["n_split"] == 0:
        return None                                     # no plain part before the gelu one
    reads, writes = (fg["src"],), (op.dst[-1],)
    j = i + 1
    while j < len(ops) and ops[j].kind in BETWEEN and not _conflicts(ops[j], reads, writes):
        j += 1
    if j == i + 1:
        return None                                     # nothing to run beside it
    w, bias, buf, off = fg["w"], fg["bias"], fg["buf"], fg["off"]
    n_split, gap, src = fg["n_split"], fg["gap"], fg["src"]
    w_plain, w_gelu = w[:n_split], w[n_split:]
    b_plain = bias[:n_split] if bias is not None else None
    b_gelu = bias[n_split:] if bias is not None else None
    g_off = off + n_split + gap
    between = [be._lower(o) for o in ops[i + 1:j]]
    cfgs: dict[int, object] = {}

    def cfg(b):            # the joined GEMV's tiles (SAME_TILES, deterministic), else each
        if not (SAME_TILES or be.deterministic):       # part's own
            return None
        if b not in cfgs:
            cfgs[b] = pick(b, w.shape[0], w.shape[1], EPI_QKV_GELU, be.deterministic)
        return cfgs[b]

    def gelu(b, env):
        gemv(be._src(src, env, b), w_gelu, b_gelu, be.bufs[buf][:b, g_off:], EPI_QKV_GELU,
             cfg=cfg(b), deterministic=be.deterministic)

    fork = be.stream_fork()

    def run(b, env):
        if b > MAX_ROWS:
            joined(b, env)
            for f in between:
                f(b, env)
            return
        gemv(be._src(src, env, b), w_plain, b_plain, be.bufs[buf][:b, off:], EPI_STORE,
             cfg=cfg(b), deterministic=be.deterministic, pdl=be.pdl_at(b, op))
        with torch.cuda.stream(fork.fork()):        # fc1 on the side stream
            gelu(b, env)
        for f in between:                            # the attention chain here
            f(b, env)
        fork.join()
    return [run], j - i
