"""Compile the Qwen 3.5 decode-step rows kernels (fast/hybrid_rows.py: conv step, gated delta
rule step, q/k norm + M-RoPE + k/v write, split gated attention + combine, zero-centred and
gated RMSNorm, SwiGLU gate) for sm_90 ahead of time, on any machine (no GPU: Triton's bundled
ptxas), at Qwen3.5-0.8B / -2B shapes in bf16 with the constexprs their wrappers choose:
compile time and registers / spills (local memory) / shared memory per kernel. What it cannot
say: speed or correctness (the interpreter tests and bench_qwen3_5_fast.py do).

Usage: PYTHONPATH=. python3 bench/compile_qwen3_5_rows.py [--sizes 0.8b,2b] [--capacity 1024]
Exits 1 when a kernel fails to compile.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from photon_core.ops import causal_conv1d, gated_delta_rule, gqa_attention, mrope  # noqa: E402
from photon_core.ops import gated_activation, rmsnorm_gated, rmsnorm_zero_centred  # noqa: E402

from photon_core.ops.launch_resources import resource_line  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# the text shapes of bench_qwen3_5.py (TEXT_REAL + SHAPES)
SIZES = {"0.8b": dict(hidden=1024, ff=3584), "2b": dict(hidden=2048, ff=6144)}
HQ, HKV, D, HK, HV, DK, DV, K = 8, 2, 256, 16, 16, 128, 128, 4
P2 = triton.next_power_of_2


def usage(k) -> str:
    """The resource line of a compiled kernel (REG, LOCAL = spill stack, SHARED)."""
    line = resource_line(k.asm["cubin"])
    return line.split(":", 1)[-1].strip() if "Function" in line else line.strip()


def compile_one(fn, types: dict, consts: dict):
    """fn's signature: constexprs from consts, pointer / scalar types from types, other
    pointers bf16, eps / scale fp32, other scalars i32."""
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        elif n in ("eps", "scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)


def kernels(size: str, capacity: int, b: int):
    s = SIZES[size]
    u8 = {"act_ptr": "*u8"}
    conv_dim = 2 * HK * DK + HV * DV
    bs = max(16, min(64, 8192 // P2(D)))
    tiles = triton.cdiv(capacity, bs)
    ns = max(1, min(tiles, 256 // HQ))
    split = triton.cdiv(tiles, ns) * bs
    ns = triton.cdiv(capacity, split)
    block_r = min(16, P2(b))
    yield "conv1d_rows", causal_conv1d._causal_conv1d_rows_kernel, u8, dict(
        HAS_ACTIVE=True, K=K, K_P2=P2(K), BC=min(256, P2(conv_dim)))
    for bv in (16, 32):          # the wrapper's choice at batch 1 / larger buckets
        yield f"delta_rows(BV={bv})", gated_delta_rule._gated_delta_rows_kernel, {
            **u8, "s_ptr": "*fp32"}, dict(HAS_ACTIVE=True, HK=HK, HV=HV, DK=DK, DV=DV,
                                          DK_P2=P2(DK), BV=bv)
    yield "qk_norm_rope_rows", mrope._qk_norm_rope_rows_kernel, {
        **u8, "pos_ptr": "*i64", "off_ptr": "*i64"}, dict(HAS_ACTIVE=True, BD=P2(D))
    fp = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
    yield f"gqa_rows_split(ns={ns})", gqa_attention._gqa_rows_split_kernel, {
        **fp, "pos_ptr": "*i64"}, dict(REP=HQ // HKV, BS=bs, BD=P2(D))
    yield "gqa_rows_combine", gqa_attention._gqa_rows_combine_kernel, fp, dict(
        NS_P2=P2(ns), BD=P2(D))
    yield "rmsnorm_zc_rows", rmsnorm_zero_centred._rmsnorm_zc_kernel, {
        "x_ptr": "*fp32", "d_ptr": "*fp32", "s_ptr": "*fp32"}, dict(HAS_DELTA=False,
                                                                      BD=P2(s["hidden"]))
    yield "rmsnorm_gated_rows", rmsnorm_gated._rmsnorm_gated_rows_kernel, {}, dict(BD=P2(DV))
    yield "silu_gate", gated_activation._gated_act_kernel, {}, dict(
        BLOCK_R=block_r, BLOCK=max(16, min(1024, P2(s["ff"])) // block_r), GELU=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.8b,2b")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--b", default="1,8", help="batch buckets (the SwiGLU gate's tiling)")
    args = ap.parse_args(argv)
    failed = 0
    seen = set()
    for size in args.sizes.split(","):
        for b in (int(x) for x in args.b.split(",")):
            for name, fn, types, consts in kernels(size, args.capacity, b):
                key = (fn.__name__, tuple(sorted(consts.items())))
                if key in seen:
                    continue
                seen.add(key)
                t0 = time.perf_counter()
                try:
                    k = compile_one(fn, types, consts)
                except Exception as e:  # noqa: BLE001 - report every kernel, then fail
                    failed += 1
                    print(f"{size} b={b} {name}: COMPILE FAILED: {type(e).__name__}: "
                          f"{str(e)[:400]}", flush=True)
                    continue
                print(f"{size} b={b} {name}: {time.perf_counter() - t0:.1f} s, {usage(k)}",
                      flush=True)
    print("all compiled" if not failed else f"{failed} kernels failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
