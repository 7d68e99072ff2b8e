"""Where the fused decode step's GPU time goes at each batch size (H200, Moondream 2 shapes,
random bf16 weights, KV capacity 832, rows at position ~785): graph replay ms against the
bandwidth floor (weights + the rows' k/v once at copy bandwidth), and the kernels of one
eager step from the torch profiler, grouped by kernel name, in us per step (their sum vs
the replay = the launch gaps).

Usage: PYTHONPATH=. python3 bench/profile_fused_step.py [--batches 1,4,8] [--split-k]
           [--one-row-attention]
Writes $OUT/profile_fused_step.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_megakernel as bm  # noqa: E402
from bench_decode import kv_bytes  # noqa: E402
from probe_encode import kernel_times  # noqa: E402


def kernel_table(fn, steps: int = 10) -> dict[str, float]:
    """us per step per kernel name over `steps` calls of fn (probe_encode.kernel_times)."""
    return {name: ms * 1e3 for name, ms, _ in kernel_times(fn, steps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--split-k", action="store_true", help="the default (non-deterministic) "
                    "fused GEMVs instead of the deterministic ones")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--one-row-attention", action="store_true",
                    help="every batch size with the one-row attention config (the scratch's "
                         "chunk, ATTEND_WARPS): the baseline of decode_attention.attend_config")
    args = ap.parse_args()
    import torch
    if args.one_row_attention:
        import photon_core.ops.decode_attention as DA
        DA.ROWS_MIN = 1 << 30
    batches = [int(b) for b in args.batches.split(",")]
    c = bm.Ctx(False, max(batches))
    if args.split_k:
        c.fd.deterministic = False
    bw, wbytes = bm._bandwidth_and_bytes(c, argparse.Namespace(smoke=False))
    out = {"gpu": torch.cuda.get_device_name(), "split_k": args.split_k, "rows": {}}
    for b in batches:
        c.state_for(b, active=False)    # nothing advances: every replay does the same work
        s0 = c.snap()

        def step():
            c.fused_step(b, False)
        g = bm._graph(torch, step)
        c.restore(s0)
        ms = bm._timed(torch, g.replay)
        c.restore(s0)
        table = kernel_table(step)
        total = sum(table.values())
        floor = (wbytes + kv_bytes(c.model.config, c.st.pos[:b].tolist())) / bw * 1e3
        row = {"graph_ms": ms, "floor_ms": floor, "kernel_us": total, "kernels": table}
        out["rows"][b] = row
        print(f"b={b}: graph {ms:.4f} ms ({ms / floor:.2f}x floor {floor:.4f}), kernels "
              f"{total / 1e3:.4f} ms (gaps {ms - total / 1e3:.4f} ms)", flush=True)
        for name, us in list(table.items())[:args.top]:
            print(f"    {us:8.1f} us  {name[:110]}", flush=True)
        c.restore(s0)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_fused_step.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
