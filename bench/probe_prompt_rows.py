"""Where the prompt rows' cost in the image-prefix prefill goes (prefix_prefill prompt_rows,
the encode with a prompt): the fused prefill with and without PROMPT_ROWS prompt rows under
the profiler, kernel time per kernel name, the differences largest first.

Usage (H200): PYTHONPATH=. python3 bench/probe_prompt_rows.py [--top 15]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core.fast.graphed_batch_encoder import PROMPT_ROWS  # noqa: E402
from photon_core.models.moondream2 import batched_encode, text  # noqa: E402
from photon_core.models.moondream2.config import MoondreamConfig  # noqa: E402
from photon_core.models.moondream2.model import build_random_model  # noqa: E402
from photon_core.models.moondream2.prefix_prefill import prefill_prefix  # noqa: E402


def kernel_us(fn, reps: int = 5) -> dict:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            tot[ev.name[:90]] += (ev.time_range.end - ev.time_range.start) / reps
    return tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--rows", default=f"{PROMPT_ROWS}", help="prompt rows to try, e.g. 16,32")
    ap.add_argument("--sdpa", default="",
                    help="prompt queries' SDPA backends to try (prefix_prefill.PROMPT_SDPA), "
                         "e.g. EFFICIENT_ATTENTION,CUDNN_ATTENTION")
    args = ap.parse_args()
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    w, t, P = m.weights, m.config.text, m.prefix_len
    x = torch.randn(1, P, t.dim, device="cuda", dtype=w.dtype)
    kv0 = batched_encode.kv_buffer(m, 1)
    with torch.inference_mode():
        a = kernel_us(lambda: prefill_prefix(w, t, x, kv0, P, fast=True, hidden=False))
    from photon_core.models.moondream2 import prefix_prefill as pp
    cases = [(int(r), None) for r in args.rows.split(",")]
    cases += [(int(args.rows.split(",")[0]), b) for b in args.sdpa.split(",") if b]
    for T, backend in cases:
        pp.PROMPT_SDPA = backend
        ids = torch.zeros(1, T, dtype=torch.long, device="cuda")
        xp = torch.cat([x, text.embed(w, ids)], dim=1)
        kv1 = batched_encode.kv_buffer(m, 1, T)
        with torch.inference_mode():
            b = kernel_us(lambda: prefill_prefix(w, t, xp, kv1, P, fast=True, prompt_rows=T))
        print(f"kernel us per prefill: without {sum(a.values()):.1f}, with {T} prompt rows "
              f"(prompt SDPA {backend or 'default'}) {sum(b.values()):.1f}")
        names = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
        for k in names[:args.top]:
            print(f"{b.get(k, 0) - a.get(k, 0):+9.1f} us  without {a.get(k, 0):8.1f}  with "
                  f"{b.get(k, 0):8.1f}  {k}")


if __name__ == "__main__":
    main()
