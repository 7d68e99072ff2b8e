"""Compile the megakernel (and the fused backend's GEMV with / without PDL) for sm_90 ahead of
time, on any machine (no GPU: Triton's bundled ptxas), at Moondream 2's shapes: the compile
time, registers, spills (local memory), shared memory per variant and batch bucket, and
whether the PDL builds carry griddepcontrol. What it cannot say: speed.

Usage: PYTHONPATH=. python3 bench/compile_megakernel.py [--variants fma/w8/s3/u4,pipe/w4/s4,...]
       [--b 1,8] [--kv 832] [--gemv-pdl] [--trace] [--hybrid qwen3.5|gemma4]
       (--hybrid: --variants of the hybrid kernel, default auto/w8/s3; --ones: also one
       build per integer argument specialized to 1)
       [--from-json megakernel_build_<family>_b<b>.json]
(variants: photon_core/megakernel/megakernel_step.py Variant strings)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from photon_core.ops.launch_resources import resource_line  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def usage(k) -> str:
    """The resource line of a compiled kernel (REG, LOCAL = spill stack, SHARED)."""
    line = resource_line(k.asm["cubin"])
    return line.split(":", 1)[-1].strip() if "Function" in line else line.strip()


def _aligned_ptrs(fn, sig: dict, ints: tuple = ()) -> dict:
    """What a launch specializes on with real tensors: 16-byte aligned pointers (and the
    given ints divisible by 16), so loads vectorize as they will on the GPU."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
            for n, t in sig.items() if t.startswith("*") or n in ints}


def moondream_shape(b: int, cap: int, chunk: int = 128) -> tuple[dict, dict]:
    """The lowering's shape dict (megakernel/lowering.py) and (n1, d, kw2, vocab, n_split)
    for Moondream 2 at bucket b, without weights."""
    from photon_core.moondream.config import MoondreamConfig
    from photon_core.models.moondream2.skill_protocol import NEXT_PHASE
    cfg = MoondreamConfig()
    t, r = cfg.text, cfg.region
    nh, nkv, hd = t.n_heads, t.n_kv_heads, t.head_dim
    n_qkv = (nh + 2 * nkv) * hd
    ls = max(r.coord_out_dim, r.size_out_dim, t.vocab_size)
    ns = math.ceil(cap / chunk)
    sh = dict(B=b, D=t.dim, SU=n_qkv + nh * hd + t.ff_dim, KW2=nh * hd + t.ff_dim,
              N1=n_qkv + t.ff_dim, V=t.vocab_size, LS=ls, NH=nh, NKV=nkv, HD=hd,
              HALF=t.rot_dim // 2, CAP=cap, N_TABLE=cap + 1, CHUNK=chunk, NSPLIT=ns,
              S_ROW=nkv * cap * hd, S_HEAD=cap * hd, S_POS=hd, NK=len(NEXT_PHASE[0]),
              OUT_COL=0)
    return sh, dict(n1=sh["N1"], d=t.dim, kw2=sh["KW2"], vocab=t.vocab_size, n_split=n_qkv)


def compile_megakernel(b: int, variant, cap: int, trace: bool = False, skip: bool = False):
    """variant: megakernel_step.Variant or its string; trace: the build with instruction
    timestamps (bench/trace_megakernel.py); returns (seconds, kernel, constexprs)."""
    from photon_core.megakernel.kernel import constexprs, megakernel
    from photon_core.megakernel.lowering import gemv_configs, is_pipe
    from photon_core.megakernel.megakernel_step import Variant
    v = Variant.parse(variant) if isinstance(variant, str) else variant
    gemv = v.gemv if v.gemv != "auto" else ("fma" if b == 1 else "small")
    unroll = v.unroll or (4 if b == 1 else 2)
    sh, dims = moondream_shape(b, cap)
    cfg = gemv_configs(b, **dims, gemv=gemv)
    kw = constexprs(sh, cfg, v.align, unroll, is_pipe(gemv), pre=v.pre, trace=trace,
                    rpf=v.rpf, early=v.early, poll1=v.poll1)
    kw["STAGES"] = v.stages
    kw["SKIP"], kw["B_P2"] = skip, triton.next_power_of_2(b)    # the stopped-rows check
    sig = {}
    types = {"table_ptr": "*i64", "queue_ptr": "*i32", "cnt_ptr": "*i32", "wb": "*bf16",
             "fb": "*fp32", "ib": "*i64", "ub": "*u8", "eps": "fp32", "scale": "fp32",
             "trace_ptr": "*i64", "stop_ptr": "*i32", "act_ptr": "*i1"}
    for name in megakernel.arg_names:
        sig[name] = "constexpr" if name in kw else types.get(name, "i64")
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(megakernel, sig, kw, attrs=_aligned_ptrs(megakernel, sig)),
                       target=TARGET,
                       options=dict(num_warps=v.warps, num_stages=v.stages,
                                    launch_cooperative_grid=True))
    return time.perf_counter() - t0, k, kw


def _tile(sh: dict, gemv: str, ks) -> dict:
    """The shape dict with the hybrid kernel's GEMV tile (hybrid_lowering.gemv_tile) for the
    family's GEMV widths ks."""
    from photon_core.megakernel.hybrid_lowering import gemv_tile
    fma, bn, bk = gemv_tile(gemv, sh["B"], ks)
    return dict(sh, FMA=fma, BN=bn, BK=bk)


def qwen3_5_shape(b: int, cap: int, gemv: str = "auto") -> dict:
    """hybrid_lowering.HybridLowering's shape dict at Qwen 3.5 0.8B's text shapes (hidden
    1024, MLP 3584, 16 + 16 DeltaNet heads of 128, 8 / 2 attention heads of 256, rotary 64,
    vocabulary 248320), without weights."""
    hk = hv = 16
    dk = dv = 128
    nh, nkv, hd, ff, d, vocab = 8, 2, 256, 3584, 1024, 248320
    conv = 2 * hk * dk + hv * dv
    su = nh * 2 * hd + 2 * nkv * hd + nh * hd + conv + hv * dv + 2 * hv + conv + 2 * hv * dv \
        + 3 * ff
    return _tile(dict(B=b, D=d, SU=su, V=vocab, LS=vocab, NK=1, OUT_COL=0, BB=16,
                IEEE=False, HK=hk, HV=hv, DK=dk, DV=dv, KC=4, CS_B=conv * 3, CS_C=3, CS_K=1,
                S_S=hv * dk * dv, NH=nh, NKV=nkv, HD=hd, R=64, NTAB=cap + 1, CAP=cap,
                S_ROW=nkv * cap * hd, S_HEAD=cap * hd, S_POS=hd, BS=32,
                NSPLIT=max(1, min(32, 132 // (b * nh))), HD_S=hd, HD_F=hd, NKV_S=nkv,
                NKV_F=nkv, BSW_S=32, BSW_F=32, HDM=hd), gemv, (d, 2 * hv * dv, ff))


def gemma4_shape(b: int, cap: int, gemv: str = "auto") -> dict:
    """HybridLowering's shape dict at Gemma 4 E2B's text shapes (hidden 1536, 8 heads, one
    k/v head, head sizes 256 sliding / 512 global, MLP 6144 and 12288, per-layer inputs of
    256, vocabulary 262144), without weights; the DeltaNet fields as the lowering fills them
    for a program without DeltaNet layers."""
    nh, d, vocab = 8, 1536, 262144
    su = 2 * (nh * 256 + 2 * 256 + nh * 256) + 2 * (nh * 512 + 2 * 512 + nh * 512) \
        + 3 * (6144 + 12288) + 2 * 256
    return _tile(dict(B=b, D=d, SU=su, V=vocab, LS=vocab, NK=1, OUT_COL=0, BB=16,
                IEEE=False, NH=nh, CAP=cap, NSPLIT=max(1, min(32, 132 // (b * nh))),
                HD_S=256, HD_F=512, NKV_S=1, NKV_F=1, BSW_S=32, BSW_F=16, HDM=512,
                HK=1, HV=1, DK=16, DV=16, KC=4, CS_B=1, CS_C=1, CS_K=1, S_S=1, NKV=1, HD=256,
                R=2, NTAB=1, S_ROW=1, S_HEAD=1, S_POS=1, BS=16),
                 gemv, (d, 256, 2048, 4096, 6144, 12288))


def compile_hybrid(b: int, cap: int, variant: str = "auto/w8/s3", family: str = "qwen3.5",
                   ints: dict | None = None, trace: bool = False):
    """The hybrid megakernel (megakernel/hybrid_kernel.py) at Qwen 3.5 0.8B's or Gemma 4
    E2B's shapes, as a megakernel_step.Variant string builds it (GEMV tile, warps, stages,
    pre, ...); ints: integer arguments' values as a launch specializes them (1: a
    constant - Triton 3.6's layout pass once failed on such a build, session 23)."""
    from photon_core.megakernel.hybrid_kernel import constexprs
    from photon_core.megakernel.megakernel_step import Variant
    v = Variant.parse(variant)
    shape = qwen3_5_shape if family == "qwen3.5" else gemma4_shape
    sh = shape(b, cap, v.gemv)
    kw = constexprs(sh, stages=v.stages, pre=v.pre, red=v.red, rpf=v.rpf, poll1=v.poll1)
    kw["ALIGNED"] = True
    kw["TRACE"] = trace
    return _compile_hybrid(kw, ints or {}, v.warps, v.stages)


# hybrid_megakernel's integer arguments (the launch's offsets and counts, hybrid_kernel.
# launch_args); --ones builds the kernel once with each of them = 1
HYBRID_INTS = ("cos_off", "sin_off", "act_off", "m_off", "l_off", "acc_off", "pos_off",
               "n_prog", "n_cnt")


def compile_recorded(path: str):
    """The hybrid megakernel exactly as an engine's launch built it
    (bench/dump_megakernel_build.py's JSON): its constexprs, and its integer arguments
    specialized as a launch specializes them (1 -> a constant, multiples of 16 -> aligned)."""
    import json
    from photon_core.megakernel.hybrid_kernel import hybrid_megakernel
    rec = json.loads(Path(path).read_text())
    # (a recording from before session 39 also holds the removed variant parts' constexprs -
    # PF, NT, SLEEP, PARG, NP_BLOCK - which no build in use set: not the kernel's any more)
    kw = {k: x for k, x in rec["constexprs"].items() if k in hybrid_megakernel.arg_names}
    return _compile_hybrid(kw, rec["ints"], rec["num_warps"],
                           rec["num_stages"], "*" + {"bfloat16": "bf16", "float16": "fp16",
                                                     "float32": "fp32"}[rec["weights_dtype"]])


def _compile_hybrid(kw: dict, ints: dict, warps: int, stages: int, wtype: str = "*bf16"):
    from photon_core.megakernel.hybrid_kernel import hybrid_megakernel
    kw = dict(kw, **{n: 1 for n, x in ints.items() if x == 1})
    types = {"table_ptr": "*i64", "queue_ptr": "*i32", "cnt_ptr": "*i32", "wb": wtype,
             "fb": "*fp32", "ib": "*i64", "ub": "*u8", "eps": "fp32", "scale": "fp32",
             "wscale": "fp32", "trace_ptr": "*i64"}
    sig = {n: "constexpr" if n in kw else types.get(n, "i64")
           for n in hybrid_megakernel.arg_names}
    t0 = time.perf_counter()
    aligned = tuple(n for n, x in ints.items() if x % 16 == 0 and x != 1)
    k = triton.compile(ASTSource(hybrid_megakernel, sig, kw,
                                 attrs=_aligned_ptrs(hybrid_megakernel, sig, aligned)),
                       target=TARGET, options=dict(num_warps=warps, num_stages=stages,
                                                   launch_cooperative_grid=True))
    return time.perf_counter() - t0, k


PTX_COUNTS = (("v4", "ld.global.v4"), ("v2", "ld.global.v2"), ("b16", "ld.global.b16"),
              ("cp.async", "cp.async.cg"), ("mma", "mma.sync"))


def describe(k) -> str:
    """Registers / spills / static shared (cuobjdump), Triton's shared memory (incl. the
    pipeline buffers), and how the loads came out in the PTX (instruction counts)."""
    ptx = k.asm["ptx"]
    counts = " ".join(f"{n}={ptx.count(pat)}" for n, pat in PTX_COUNTS)
    return f"{usage(k)} | triton shared {k.metadata.shared} B | PTX {counts}"


def compile_gemv(pdl: bool):
    from photon_core.ops.gemv import _gemv_kernel
    sig = {n: "constexpr" for n in ("EPI", "HAS_BIAS", "SPLIT_K", "BLOCK_B", "BLOCK_N",
                                    "BLOCK_K", "DOT", "PDL", "GDC", "IEEE", "ACT", "LATE",
                                    "TMA", "RELAXED")}
    sig.update({"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16",
                "mul_ptr": "*bf16"})
    for n in ("B", "N", "K", "stride_xb", "stride_yb", "n_split", "gap", "stride_mb"):
        sig[n] = "i32"
    const = dict(EPI=1, HAS_BIAS=True, SPLIT_K=1, BLOCK_B=16, BLOCK_N=64, BLOCK_K=128,
                 DOT=True, PDL=pdl, GDC=pdl, IEEE=False, ACT=0, LATE=pdl, TMA=False,
                 RELAXED=True)
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(_gemv_kernel, sig, const,
                                 attrs=_aligned_ptrs(_gemv_kernel, sig, ("K",))),
                       target=TARGET,
                       options=dict(num_warps=4, num_stages=3, launch_pdl=pdl))
    return time.perf_counter() - t0, k


DEFAULT_VARIANTS = "fma/w8/s3/u4/noalign,fma/w8/s3/u4,pipe_fma/w8/s4,pipe/w4/s4,fused/w8/s3/u1"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="megakernel_step.Variant strings, comma-separated")
    ap.add_argument("--b", default="1,8")
    ap.add_argument("--kv", type=int, default=832)
    ap.add_argument("--gemv-pdl", action="store_true", help="also the fused GEMV +- PDL")
    ap.add_argument("--trace", action="store_true", help="the builds with instruction timestamps")
    ap.add_argument("--skip", action="store_true",
                    help="the builds that skip their work when every active row has stopped")
    ap.add_argument("--hybrid", choices=["qwen3.5", "gemma4"], default=None,
                    help="the hybrid families' kernel at Qwen 3.5 0.8B's or Gemma 4 E2B's "
                         "shapes instead")
    ap.add_argument("--ones", action="store_true",
                    help="--hybrid: also one build per integer argument specialized to 1 (the "
                         "others 32: aligned), first variant, first batch size")
    ap.add_argument("--from-json", default=None,
                    help="the hybrid megakernel as bench/dump_megakernel_build.py recorded it")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90", flush=True)
    if a.from_json:
        dt, k = compile_recorded(a.from_json)
        print(f"{a.from_json}: compile {dt:.1f} s, {describe(k)}", flush=True)
        return
    if a.hybrid:
        variants = a.variants if a.variants != DEFAULT_VARIANTS else "auto/w8/s3"
        for b in (int(x) for x in a.b.split(",")):
            for v in variants.split(","):
                dt, k = compile_hybrid(b, a.kv, v, family=a.hybrid, trace=a.trace)
                print(f"hybrid megakernel {a.hybrid} b={b} {v}: compile {dt:.1f} s, "
                      f"{describe(k)}", flush=True)
        if a.ones:
            b, v = int(a.b.split(",")[0]), variants.split(",")[0]
            for name in HYBRID_INTS:
                ints = {n: 32 for n in HYBRID_INTS}
                ints["n_prog"] = 132
                ints[name] = 1
                dt, k = compile_hybrid(b, a.kv, v, family=a.hybrid, ints=ints)
                print(f"hybrid megakernel {a.hybrid} b={b} {v} {name}=1: compile {dt:.1f} s, "
                      f"{describe(k)}", flush=True)
        return
    if a.gemv_pdl:
        for pdl in (False, True):
            dt, k = compile_gemv(pdl)
            print(f"gemv [qkv|fc1] 64x128 dot pdl={pdl}: {dt:.1f} s, {usage(k)}, "
                  f"griddepcontrol in PTX: {'griddepcontrol' in k.asm['ptx']}", flush=True)
    for b in (int(x) for x in a.b.split(",")):
        for v in a.variants.split(","):
            try:
                dt, k, kw = compile_megakernel(b, v, a.kv, a.trace, a.skip)
                un = {n: kw[f"{n}_UN"] for n in ("W1", "W2", "LM")}
                print(f"megakernel b={b} {v} unroll {un}: compile {dt:.1f} s, {describe(k)}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"megakernel b={b} {v}: FAILED {type(e).__name__}: {str(e)[:1500]}",
                      flush=True)


if __name__ == "__main__":
    main()
