"""masked_argmax over long rows (H200): one program per row (the form before session 10)
against the two-launch chunked form (the default from SPLIT_MIN logits), same run, CUDA
graphs of 20 calls (bench_timing.graph_ms), and whether both give torch.argmax's picks.
Vocabularies: Moondream 2 51,200, Qwen 3.5 248,320, Gemma 4 262,144; 1 and 8 rows.

Usage (H200): PYTHONPATH=. python3 bench/bench_argmax.py
Writes $OUT/bench_argmax.json when OUT is set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
import photon_core.ops.masked_argmax as MA  # noqa: E402


def main():
    out = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for vocab in (51200, 248320, 262144):
        for b in (1, 8):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(b, vocab, device="cuda", dtype=dt)
                want = x.float().argmax(-1)
                res = {"vocab": vocab, "rows": b, "dtype": str(dt)}
                for name, split_min in (("one_program", 1 << 40), ("chunked", MA.SPLIT_MIN)):
                    keep, MA.SPLIT_MIN = MA.SPLIT_MIN, split_min
                    try:
                        o = torch.full((b, 1), -1, device="cuda", dtype=torch.long)
                        MA.masked_argmax(x, o, 0)
                        res[name + "_same_as_torch"] = bool((o[:, 0] == want).all())
                        res[name + "_us"] = round(graph_ms(lambda: MA.masked_argmax(x, o, 0))
                                                  * 1e3, 2)
                    finally:
                        MA.SPLIT_MIN = keep
                out["rows"].append(res)
                print(res, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_argmax.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
