"""Compile every Triton launch of Gemma 4's step program in the runtime's fused backend
for sm_90 on any machine (no GPU: Triton's bundled ptxas), at E2B shapes: decode steps at
batch 1 / 4 / 16, the lm head (GEMV, softcap, argmax) and a 16-token prefill; with --what,
Qwen 3.5's kernels, Moondream 2's fused step or the encoders' kernels instead. The launches
are recorded, not run (ops/launch_resources.py), so weights are uninitialized memory of the
real shapes. Prints registers, spills and shared memory per distinct launch and fails (exit
1) when one asks for more shared memory than the H200 has (232,448 bytes per block).

Usage: PYTHONPATH=. python3 bench/compile_sm90.py [--what gemma4,qwen3_5 | moondream |
       moondream_encode | gemma4_encode] [--dtype bf16] [--layers 35]
       [--kv-shared 20] [--vocab 262144] [--b 1,4,16] [--sass] [--json]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest.mock import patch

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the Gluon vision attention's configs (BM, BN, STAGES, PIPE[, WS]) compiled here: one per
# kind the probe times (BM 64 / 128, BN 32 / 64, 2-4 stages, PIPE off / on, a partition per
# warpgroup; session 43 compiled 8 - 124-179 registers, 51-92 KB, no spills - but 64 x 128
# with PIPE spills 24 bytes; session 44 the per-warpgroup form: 128 registers, no spills at
# BN 32 / 64 with Triton 3.6 (the H200's), 176 bytes at BN 128; Triton 3.9 spills 24 bytes
# at BN 64, so CI compiles BN 32)
GLUON_CONFIGS = ((64, 64, 2, 0), (64, 64, 2, 1), (128, 64, 3, 1), (64, 32, 4, 1),
                 (128, 32, 4, 0, "wg"))


def e2b_text_config(layers=35, kv_shared=20, vocab=262144, kv_heads=1) -> dict:
    """E2B's shapes (bench/bench_gemma4.py's e2b_config) with the tiny model's token ids."""
    from bench.bench_gemma4 import e2b_config
    return e2b_config({}, layers, kv_shared, kv_heads, vocab)


def fused_launches(dtype=torch.bfloat16, layers=35, kv_shared=20, vocab=262144,
                   batches=(1, 4, 16), capacity=1024, prefill=16):
    """Every launch the fused executor makes at these shapes (recorded, not run)."""
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
    with torch.inference_mode(), record_launches() as launches:
        step_launches(spec, weights, batches, capacity, capacity // 2, prefill)
    return launches


def step_launches(spec, weights, batches, capacity: int, pos: int, prefill: int,
                  **options) -> None:
    """A fused StepState's launches (inside record_launches): the lm head and a forward at
    each batch size with every row at `pos`, then a `prefill`-token prompt prefill."""
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds
    st = ds.StepState.of_spec(spec, weights, max(batches), capacity,
                              EngineOptions(fused="on", **options))
    st.pos.fill_(pos)
    for b in batches:
        st.active[:b] = True
        ds.lm_greedy(st, b)
        ds.forward(st, b)
    if prefill:
        st.prefill_tokens(0, 0, torch.arange(prefill), backend=st.fused)


def qwen3_5_launches(dtype=torch.bfloat16):
    """The launches of test_qwen3_5_kernels.py::test_real_sizes_on_gpu (recorded, not run)."""
    from photon_core.ops import causal_conv1d, gqa_attention, mrope, rmsnorm_gated
    from photon_core.ops import gated_delta_rule as gdr
    from photon_core.ops import rmsnorm_zero_centred as rzc
    from photon_core.ops.launch_resources import record_launches

    def e(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt)
    with torch.inference_mode(), record_launches() as launches:
        causal_conv1d.causal_conv1d_step_triton(e(1, 6144), e(6144, 4), e(1, 6144, 3))
        # the fast encode's conv over the image prefix, in the in-projection's row layout
        causal_conv1d.causal_conv1d_prefill_triton(e(1000, 6144), e(6144, 4), e(1, 6144, 3))
        rzc.rmsnorm_zero_centred_triton(e(1, 2048), e(2048), 1e-6, delta=e(1, 2048))
        rmsnorm_gated.rmsnorm_gated_triton(e(16, 128), e(16, 128), e(128))
        pos = torch.tensor([[900], [905], [911]])
        cos, sin = mrope.mrope_cos_sin(pos, 64, 1e7, (11, 11, 10), dtype)
        mrope.qk_norm_rope_triton(e(8, 256), e(2, 256), e(256), e(256), cos[0], sin[0])
        gqa_attention.gated_gqa_decode_triton(e(8, 256), e(2, 1100, 256), e(2, 1100, 256),
                                              1000, e(8, 256))
        t, h, d = 1000, 16, 128
        q, k, v = e(1, t, h, d), e(1, t, h, d), e(1, t, h, d)
        g, beta = e(1, t, h, dt=torch.float32), e(1, t, h, dt=torch.float32)
        s0 = e(1, h, d, d, dt=torch.float32)
        two = gdr.SCAN_TWO_PASS            # the scan in one pass and in two (SCAN_TWO_PASS)
        try:
            for gdr.SCAN_TWO_PASS in (False, True):
                gdr.gated_delta_chunked_triton(q, k, v, g, beta, s0)
        finally:
            gdr.SCAN_TWO_PASS = two
        # the fast encode's FAST_PREP: what feeds the scan kernel, one launch
        gdr._fast_prep(k, v, g, beta, gdr.SCAN_CHUNK,
                       "ieee" if dtype == torch.float32 else "tf32")
        # ... with the gates made in it from the raw projections (FAST_GATES)
        gdr._fast_prep(k, v, e(1, t, h), e(1, t, h), gdr.SCAN_CHUNK,
                       "ieee" if dtype == torch.float32 else "tf32", (e(h), e(h)))
        # FAST_SOLVE: the chunks' unit lower-triangular systems (16 heads x 16 chunks of 64)
        from photon_core.ops.unit_lower_solve import unit_lower_solve_triton
        unit_lower_solve_triton(e(h, 16, 64, 64, dt=torch.float32),
                                e(h, 16, 64, 2 * d, dt=torch.float32))
        gdr.gated_delta_step_triton(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
        # a decode bucket's Gated DeltaNet layer in one launch (fast/hybrid_rows.py)
        from photon_core.ops.delta_net_rows import delta_net_rows_triton
        c = 2 * h * d + h * d
        delta_net_rows_triton(e(8, c), e(8, h * d), e(8, h), e(8, h), e(c, 4), e(8, c, 3),
                              e(h, dt=torch.float32), e(h), e(d), e(8, h, d, d,
                                                                 dt=torch.float32),
                              (h, h, d, d), 1e-6)
    return launches


def moondream_launches(dtype=torch.bfloat16, batches=(1, 2, 8), capacity=1024, prefill=16):
    """Every launch of Moondream 2's fused step at its real shapes (recorded, not run): the
    lm / region heads and the decoder step at each batch, in the default mode and in
    deterministic mode, plus a 16-token prompt prefill; also the launches the fused backend
    makes on a Hopper GPU (griddepcontrol and the GEMVs' TMA weight tiles forced on here,
    where no CUDA device says they may be)."""
    from types import SimpleNamespace

    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.program import step_spec
    from photon_core.models.moondream2.weights import expected_shapes
    from photon_core.ops import gemv, pdl
    from photon_core.ops.launch_resources import record_launches

    cfg = MoondreamConfig()
    weights = {k: torch.empty(s, dtype=dtype) for k, s in expected_shapes(cfg).items()
               if not k.startswith("vision.")}
    spec = step_spec(SimpleNamespace(config=cfg, weights=SimpleNamespace(device="cpu",
                                                                          dtype=dtype)))
    with torch.inference_mode(), record_launches() as launches:
        for det in (False, True):
            step_launches(spec, weights, batches, capacity, capacity - 264, prefill,
                          deterministic=det)
            with patch.object(pdl, "gdc_available", lambda t: pdl.HAVE_GDC), \
                    patch.object(gemv, "tma_capable", lambda w: True):
                step_launches(spec, weights, batches, capacity, capacity - 264, prefill,
                              deterministic=det)
    return launches


def moondream_encode_launches(dtype=torch.bfloat16):
    """The Triton launches of Moondream 2's fast encode at real shapes (recorded, not run):
    the image-prefix prefill's rope_kv_write (730 tokens, 1 and 4 frames, 32 + 32 heads of
    64) and add + bias + LayerNorm (dim 2048), the vision tower's add + LayerNorm (1152),
    and in 16-bit dtypes the vision attention's Triton configs and, where Triton has
    Gluon, the Gluon kernel's (GLUON_CONFIGS; its Hopper test forced true here)."""
    from photon_core.ops.add_layernorm import add_layernorm
    from photon_core.ops.launch_resources import record_launches
    from photon_core.ops.rope import rope_angles
    from photon_core.ops.rope_kv_write import rope_kv_write
    from photon_core.ops import vision_attention_gluon as G
    from photon_core.ops.vision_attention import TIMED_CONFIGS, vision_attention

    def e(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt)
    cos, sin = rope_angles(torch.arange(730), 32)
    with torch.inference_mode(), record_launches() as launches:
        for n in (1, 4):
            kv = e(2, 2, n, 32, 730, 64)
            rope_kv_write(e(n, 730, 96 * 64), cos, sin, 32, 32, kv[1, 0], kv[1, 1])
            add_layernorm(e(n, 730, 2048), e(n, 730, 2048), e(2048), e(2048), t_bias=e(2048))
        add_layernorm(e(9, 729, 1152), e(9, 729, 1152), e(1152), e(1152))
        if dtype != torch.float32:      # the vision attention runs in the model's 16-bit dtype
            for cfg in TIMED_CONFIGS:
                vision_attention(e(9, 729, 3 * 1152), 16, cfg)
            if G.HAVE_GLUON:
                with patch.object(G, "gluon_available", lambda t: True):
                    for cfg in GLUON_CONFIGS:
                        G.vision_attention_gluon(e(9, 729, 3 * 1152), 16, cfg)
    return launches


def gemma4_encode_launches(dtype=torch.bfloat16):
    """The Triton launch of Gemma 4's fast vision tower that only it makes (recorded, not
    run): q / k's per-head norm + axial rotary (norm_rotary_triton, halves=2) over a 640x480
    frame's 2520 patches, 12 heads of 64, read from the q | k | v GEMM's output."""
    from photon_core.ops.launch_resources import record_launches
    from photon_core.ops.rotary_half import norm_rotary_triton

    def e(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt)
    n, h, d = 2520, 12, 64
    with torch.inference_mode(), record_launches() as launches:
        qkv = e(n, 3 * h * d)
        norm_rotary_triton(qkv[:, :h * d], e(d), e(n, d), e(n, d), torch.arange(n), d, 1e-6,
                           halves=2)
    return launches


def check(what: str, dtype: torch.dtype, **kw) -> list:
    """Compile the launches of `what` ("gemma4" / "gemma4_encode" / "qwen3_5" /
    "moondream" / "moondream_encode")."""
    from photon_core.ops.launch_resources import compile_launches
    launches = (fused_launches(dtype, **kw) if what == "gemma4" else
                gemma4_encode_launches(dtype) if what == "gemma4_encode" else
                moondream_encode_launches(dtype) if what == "moondream_encode" else
                moondream_launches(dtype) if what == "moondream" else
                qwen3_5_launches(dtype))
    return compile_launches(launches)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="gemma4,qwen3_5")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--kv-shared", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--b", default="1,4,16")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sass", action="store_true",
                    help="also each launch's machine-code fingerprint (launch_resources."
                         "sass_fingerprint: a refactor that claims the same code compares "
                         "these before and after)")
    a = ap.parse_args()
    import json

    import triton

    from photon_core.ops.launch_resources import SM90_SHARED_LIMIT
    gemma_kw = dict(layers=a.layers, kv_shared=a.kv_shared, vocab=a.vocab,
                    batches=tuple(int(x) for x in a.b.split(",")))
    rows, bad = [], 0
    for what in a.what.split(","):
        for dt in a.dtype.split(","):
            res = check(what, DTYPES[dt], **(gemma_kw if what == "gemma4" else {}))
            if not a.json:
                print(f"triton {triton.__version__}, sm_90, {what} {dt}: {len(res)} distinct "
                      "launches", flush=True)
            for r in res:
                bad += not r.fits
                rows.append(dict(what=what, dtype=dt, kernel=r.launch.name,
                                 launch=r.launch.describe(), shared=r.shared,
                                 registers=r.registers, spill=r.spill, error=r.error,
                                 fits=r.fits, tf32=r.tf32, sass=r.sass_sha))
                if not a.json:
                    status = "ok" if r.fits else "DOES NOT FIT"
                    print(f"{status:12s} shared {r.shared:7d} regs {r.registers:3d} spill "
                          f"{r.spill:5d}{' tf32' if r.tf32 else ''}"
                          f"{' sass ' + r.sass_sha if a.sass else ''}  {r.launch.describe()}"
                          + (f"  {r.error}" if r.error else ""), flush=True)
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"limit {SM90_SHARED_LIMIT} bytes; {bad} launches do not fit")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
