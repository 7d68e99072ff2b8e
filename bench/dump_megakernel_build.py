"""Write what the hybrid megakernel's launch compiles for a family's engine (H200): the
kernel's constexprs, its integer arguments and the launch options, one JSON file per batch
bucket, so `bench/compile_megakernel.py --from-json FILE` rebuilds exactly that kernel on any
machine (Triton's ptxas, no GPU) - e.g. with the GPU's Triton version where a build fails
there and not here.

Usage (H200): PYTHONPATH=. python3 bench/dump_megakernel_build.py --family gemma4-e2b
                  [--batches 1,8] [--variant auto/w8/s2] [--out DIR ($OUT or .)]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.sweep_gemv_family import build_model  # noqa: E402


def build_record(step) -> dict:
    """The launch of MegakernelStep `step` (hybrid) as its run_kernel makes it."""
    from photon_core.megakernel import hybrid_kernel as hk
    v, warps = step.variant, step.num_warps or 8
    args, kw = hk.launch_args(step.compiled, step.low, step.gemv_aligned, v.stages, v.pre,
                              red=v.red, rpf=v.rpf, poll1=v.poll1)
    named = dict(zip(hk.hybrid_megakernel.arg_names, args))
    return {"constexprs": kw,
            "ints": {n: x for n, x in named.items() if isinstance(x, int)},
            "floats": {n: float(x) for n, x in named.items() if isinstance(x, float)},
            "num_warps": warps, "num_stages": v.stages,
            "weights_dtype": str(step.compiled.bases["w"].dtype).removeprefix("torch."),
            "gpu": torch.cuda.get_device_name(), "triton": __import__("triton").__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gemma4-e2b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variant", default="auto/w8/s2")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from photon_core.fast import FastEngine
    from photon_core.megakernel.megakernel_step import MegakernelStep
    batches = [int(b) for b in a.batches.split(",")]
    fe = FastEngine(build_model(a.family), max_batch=max(batches), kv_capacity=1024,
                    megakernel="off")
    for b in batches:
        step = MegakernelStep(fe.state.fused, fe.state, b, variant=a.variant, head=False)
        path = Path(a.out, f"megakernel_build_{a.family}_b{b}.json")
        path.write_text(json.dumps(build_record(step), indent=1))
        print(f"wrote {path}", flush=True)
    fe.close()


if __name__ == "__main__":
    main()
