"""Compile every Triton launch of Gemma 4's fused step executor (models/gemma4/backend_ext.py)
for sm_90 on any machine (no GPU: Triton's bundled ptxas), at E2B shapes: decode steps at
batch 1 / 4 / 16, the lm head (GEMV, softcap, argmax) and a 16-token prefill. The launches
are recorded, not run (ops/launch_resources.py), so weights are uninitialized memory of the
real shapes. Prints registers, spills and shared memory per distinct launch and fails (exit
1) when one asks for more shared memory than the H200 has (232,448 bytes per block).

Usage: PYTHONPATH=. python3 bench/compile_gemma4.py [--dtype bf16] [--layers 35]
       [--kv-shared 20] [--vocab 262144] [--b 1,4,16]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def e2b_text_config(layers=35, kv_shared=20, vocab=262144, kv_heads=1) -> dict:
    """E2B's text shapes (bench/bench_gemma4.py's e2b_config) on the tiny model's dict."""
    from photon_core.models.gemma4.test_model import tiny_config_dict
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
             for i in range(layers)]
    base = tiny_config_dict(512)
    t = {**base["text_config"], "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
         "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": layers,
         "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 256,
         "layer_types": types,
         "per_layer_config": {str(i): {"head_dim": 512} for i, ty in enumerate(types)
                              if ty == "full_attention"},
         "sliding_window": 512, "hidden_size_per_layer_input": 256,
         "num_kv_shared_layers": kv_shared, "use_double_wide_mlp": True,
         "max_position_embeddings": 131072}
    return {**base, "text_config": t}


def fused_launches(dtype=torch.bfloat16, layers=35, kv_shared=20, vocab=262144,
                   batches=(1, 4, 16), capacity=1024, prefill=16):
    """Every launch the fused executor makes at these shapes (recorded, not run)."""
    from photon_core.fast import decode_step as ds
    from photon_core.models.gemma4.backend_ext import Gemma4StepState
    from photon_core.models.gemma4.config import parse_config
    from photon_core.models.gemma4.program import step_program
    from photon_core.models.gemma4.weights import expected_shapes
    from photon_core.ops.launch_resources import record_launches
    from photon_core.program import StepSpec

    cfg = parse_config(e2b_text_config(layers, kv_shared, vocab))
    # uninitialized (never touched: the 4.7 GB per-layer table costs no memory)
    weights = {k: torch.empty(s, dtype=dtype) for k, s in expected_shapes(cfg).items()
               if k.startswith("language_model.")}
    spec = StepSpec(step_program(cfg.text, cfg.tied), phase_next=((0,),))
    rows = max(batches)
    with torch.inference_mode(), record_launches() as launches:
        st = Gemma4StepState(spec, weights, rows=rows, capacity=capacity, fused=True)
        st.pos.fill_(capacity // 2)
        for b in batches:
            st.active[:b] = True
            ds.lm_greedy(st, b)
            ds.forward(st, b)
        if prefill:
            st.backend.prefill(torch.arange(prefill), 0, 0)
    return launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--kv-shared", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--b", default="1,4,16")
    a = ap.parse_args()
    from photon_core.ops.launch_resources import SM90_SHARED_LIMIT, compile_launches, distinct
    import triton
    launches = fused_launches(DTYPES[a.dtype], a.layers, a.kv_shared, a.vocab,
                              tuple(int(x) for x in a.b.split(",")))
    print(f"triton {triton.__version__}, sm_90, {a.dtype}: {len(launches)} launches, "
          f"{len(distinct(launches))} distinct", flush=True)
    bad = 0
    for r in compile_launches(launches):
        status = "ok" if r.fits else "DOES NOT FIT"
        bad += not r.fits
        print(f"{status:12s} shared {r.shared:7d} regs {r.registers:3d} spill {r.spill:5d}  "
              f"{r.launch.describe()}" + (f"  {r.error}" if r.error else ""), flush=True)
    print(f"limit {SM90_SHARED_LIMIT} bytes; {bad} launches do not fit")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
