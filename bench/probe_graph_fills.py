"""What a captured cuDNN attention call puts in a CUDA graph, and whether graph_fills can drop
its unread zero fills (H200). Captures one attention call at the vision encoder's shape
([9 crops, 16 heads, 729, 72] bf16) three ways: F.scaled_dot_product_attention, the
ops/sdpa.py op with a collecting capture (cuda_graph_runner.capture_graph, DROP_FILLS on)
and off; lists each graph's nodes (type; memset destination / bytes), what the op noted,
what was dropped, the outputs' bits and each graph's replay time (a chain of --calls calls).

Usage (H200): PYTHONPATH=. python3 bench/probe_graph_fills.py [--calls 27]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core import graph_fills  # noqa: E402
from photon_core.fast import cuda_graph_runner as cgr  # noqa: E402
from photon_core.ops import sdpa  # noqa: E402

KINDS = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty"}


def describe(raw: int) -> list[str]:
    a = graph_fills.api()
    out = []
    for n in a.nodes(raw):
        k = a.kind(n)
        d = KINDS.get(k, str(k))
        if k == graph_fills.MEMSET:
            dst, nb = a.memset(n)
            d += f" dst {dst:#x} bytes {nb}"
        out.append(d)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=27)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g0 = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(9, 16, 729, 72, device=dev, dtype=torch.bfloat16, generator=g0)
               for _ in range(3))
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "sdp choice", int(torch._fused_sdp_choice(q, k, v)))
    aten = torch.ops.aten._scaled_dot_product_cudnn_attention
    for form, fn in (("F.sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
                     ("aten cudnn op", lambda: aten(q, k, v, None, False, 0.0, False, False))):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            gk = torch.cuda.CUDAGraph(keep_graph=True)
            gk.capture_begin()
            try:
                tail = graph_fills.api().capture_tail(s.cuda_stream)
                y = fn()
                tail2 = graph_fills.api().capture_tail(s.cuda_stream)
            finally:
                gk.capture_end()
        if isinstance(y, tuple):
            print(form, "seed / offset:", [(hex(t.data_ptr()), t.numel(), t.dtype)
                                          for t in y[6:8]])
        print(form, "capture tails", tail, tail2)
        print(form, "graph nodes:", describe(gk.raw_cuda_graph()))
        gk.instantiate()
        gk.replay()
        torch.cuda.synchronize()

    def chain(fn):
        def run():
            x = q
            for _ in range(args.calls):
                x = fn(x, k, v)
            return x
        return run

    res = {}
    for label, drop, fn in (("F.sdpa", False, F.scaled_dot_product_attention),
                            ("op, kept", False, sdpa.attention),
                            ("op, dropped", True, sdpa.attention)):
        cgr.DROP_FILLS = drop
        try:
            with torch.inference_mode():
                run = chain(fn)
                cgr.warm_up(run)
                g, out = cgr.capture_graph(run)
            if getattr(g, "photon_kept", False):
                print(label, "nodes after:", describe(g.raw_cuda_graph())[:8], "...")
            print(label, "dropped", getattr(g, "photon_dropped", None))
            times = []
            for _ in range(7):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            res[label] = out.clone()
            print(f"{label}: replay {min(times):.4f} ms ({args.calls} calls), "
                  f"bits as F.sdpa's: {torch.equal(out, res['F.sdpa'])}", flush=True)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
