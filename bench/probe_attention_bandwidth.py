"""Where the decode attention's time goes at 2-8 rows (H200, Moondream 2's shapes: 32 heads of
64, a 1024-slot cache, rows at position --pos, bf16): the shipped kernel (attend + combine,
the engine's defaults) against kernels that only READ the same keys / values, so the gap
between them is the attention's own cost and the gap to the copy bandwidth the access's:

  shipped      decode_attention (attend + combine), ops/decode_attention.py's defaults
  attend       its attend kernel alone (no combine launch)
  read         the attend kernel's grid (row, head, 64-key split), each program loading its
               split's keys / values (masked past the row's position, the position loaded
               first, as there) and storing one sum - no rotary, softmax or partials
  read_pos     the same with the position a kernel argument (no dependent load first)
  stream/S     one program per (row, head, S consecutive 64-key chunks), the chunks loaded in
               a software-pipelined loop (tl.range num_stages 3): fewer, longer programs
  loop/S       stream/S's loop computing an online softmax (q . k, exp, p . v) and storing
               partials: what a looped attention kernel would cost (no rotary / k-v write)

Each as a CUDA graph over 24 layers' distinct caches (nothing stays in L2), us per layer and
TB/s of the rows' k/v (positions 0..pos of each row), with the copy bandwidth of the same
run. Nothing here is an engine path: a diagnostic of where a faster kernel has room.

Usage: PYTHONPATH=. python3 bench/probe_attention_bandwidth.py [--batches 2,4,8] [--pos 760]
           [--stream 3,6,12]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import copy_bandwidth, graph_ms  # noqa: E402
import photon_core.ops.decode_attention as DA  # noqa: E402
from photon_core.ops._triton import tl, triton  # noqa: E402
from photon_core.ops.rope import rope_angles  # noqa: E402

NH, HD, CAP, LAYERS, ROT, CHUNK = 32, 64, 1024, 24, 32, 64


@triton.jit
def _read_kernel(kc_ptr, vc_ptr, pos_ptr, pos_arg, s_row, s_head, s_pos, capacity, out_ptr,
                 NH: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr,
                 NSPLIT: tl.constexpr, POS_ARG: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    if POS_ARG:
        pos = pos_arg - row
    else:
        pos = tl.load(pos_ptr + row)
    pw = tl.minimum(pos, capacity - 1)
    if sp * CHUNK <= pw:
        d = tl.arange(0, HD)
        j = sp * CHUNK + tl.arange(0, CHUNK)
        off = row * s_row + h * s_head + j[:, None] * s_pos + d[None, :]
        ok = (j < pw)[:, None]
        kt = tl.load(kc_ptr + off, mask=ok, other=0.0)
        vt = tl.load(vc_ptr + off, mask=ok, other=0.0)
        s = tl.sum(tl.sum(kt.to(tl.float32) + vt.to(tl.float32), axis=1), axis=0)
        tl.store(out_ptr + (row * NH + h) * NSPLIT + sp, s)


@triton.jit
def _loop_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, s_row, s_head, s_pos, capacity,
                 m_ptr, l_ptr, acc_ptr, scale,
                 NH: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr, PER: tl.constexpr,
                 NPART: tl.constexpr, SOFTMAX: tl.constexpr, STAGES: tl.constexpr):
    """Program (row, head, part): chunks part*PER .. of the row's keys up to its position,
    streamed in a pipelined loop; SOFTMAX: online-softmax partials, else a read-only sum."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    pw = tl.minimum(tl.load(pos_ptr + row), capacity - 1)
    c0 = part * PER
    n_it = tl.minimum(PER, pw // CHUNK + 1 - c0)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (row * NH + h) * HD + d).to(tl.float32)
    base = row * s_row + h * s_head
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([HD], tl.float32)
    for it in tl.range(0, n_it, num_stages=STAGES):
        j = (c0 + it) * CHUNK + tl.arange(0, CHUNK)
        ok = j <= pw
        off = base + j[:, None] * s_pos + d[None, :]
        kt = tl.load(kc_ptr + off, mask=ok[:, None], other=0.0)
        vt = tl.load(vc_ptr + off, mask=ok[:, None], other=0.0)
        if SOFTMAX:
            sc = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * scale
            sc = tl.where(ok, sc, float("-inf"))
            mn = tl.maximum(m, tl.max(sc, axis=0))
            a = tl.exp(m - mn)
            p = tl.exp(sc - mn)
            l = l * a + tl.sum(p, axis=0)
            acc = acc * a + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
            m = mn
        else:
            acc += tl.sum(kt.to(tl.float32) + vt.to(tl.float32), axis=0)
    idx = (row * NH + h) * NPART + part
    if n_it > 0:
        tl.store(m_ptr + idx, m)
        tl.store(l_ptr + idx, l)
        tl.store(acc_ptr + idx * HD + d, acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--pos", type=int, default=760)
    ap.add_argument("--stream", default="3,6,12", help="chunks per program of stream / loop")
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    cos, sin = (t.contiguous().to(dev) for t in rope_angles(torch.arange(CAP + 1), ROT))
    g = torch.Generator(device=dev).manual_seed(0)
    nsplit = CAP // CHUNK
    for b in (int(v) for v in args.batches.split(",")):
        kv = torch.randn(LAYERS, 2, b, NH, CAP, HD, device=dev, dtype=torch.bfloat16,
                         generator=g)
        qkv = torch.randn(LAYERS, b, 3 * NH * HD, device=dev, dtype=torch.bfloat16,
                          generator=g)
        pos = torch.full((b,), args.pos, device=dev, dtype=torch.long)
        res = torch.empty(LAYERS, b, NH * HD, device=dev, dtype=torch.bfloat16)
        kv_bytes = b * 2 * NH * (args.pos + 1) * HD * 2
        scratch = DA.AttentionScratch(b, NH, HD, CAP, 128, dev, min_chunk=CHUNK)
        out = torch.empty(b * NH * nsplit, device=dev, dtype=torch.float32)   # read's sums
        kc0 = kv[0, 0]
        st = kc0.stride()

        def report(name, fn):
            try:
                us = graph_ms(fn, calls=3) * 1e3 / LAYERS
            except Exception as e:      # noqa: BLE001 - a form that does not build: say so
                print(f"  b={b} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return
            print(f"  b={b} {name:12s} {us:7.2f} us/layer  {kv_bytes / (us * 1e-6) / 1e12:.2f} "
                  f"TB/s ({kv_bytes / bw * 1e6:.2f} us at the copy bandwidth)", flush=True)

        def shipped():
            for i in range(LAYERS):
                DA.decode_attention(qkv[i], pos, cos, sin, kv[i, 0], kv[i, 1], res[i],
                                    scratch, NH, NH, HD)
        report("shipped", shipped)

        def attend_only():
            for i in range(LAYERS):
                DA._attend_partial_kernel[(b, NH, nsplit)](
                    qkv[i], qkv.stride(1), pos, cos, sin, cos.shape[0], kv[i, 0], kv[i, 1],
                    st[0], st[1], st[2], CAP, scratch.m, scratch.l, scratch.acc, HD ** -0.5,
                    scratch.count, res[i], res.stride(1), pos,
                    NH=NH, NKV=NH, HD=HD, HALF=cos.shape[1], CHUNK=CHUNK, NSPLIT=nsplit,
                    COMBINE=False,
                    num_warps=DA.ROWS_WARPS, SKIP_EMPTY=DA.SKIP_EMPTY_SPLITS)
        report("attend", attend_only)
        for name, pos_arg in (("read", False), ("read_pos", True)):
            def read(pos_arg=pos_arg):
                for i in range(LAYERS):
                    _read_kernel[(b, NH, nsplit)](
                        kv[i, 0], kv[i, 1], pos, args.pos, st[0], st[1], st[2], CAP, out,
                        NH=NH, HD=HD, CHUNK=CHUNK, NSPLIT=nsplit, POS_ARG=pos_arg,
                        num_warps=DA.ROWS_WARPS)
            report(name, read)
        q = qkv[:, :, :NH * HD].contiguous()
        for per in (int(v) for v in args.stream.split(",")):
            nparts = triton.cdiv(nsplit, per)
            for name, softmax in (("stream", False), ("loop", True)):
                for warps in (2, 4):
                    def loop(per=per, nparts=nparts, softmax=softmax, warps=warps):
                        for i in range(LAYERS):
                            _loop_kernel[(b, NH, nparts)](
                                q[i], kv[i, 0], kv[i, 1], pos, st[0], st[1], st[2], CAP,
                                scratch.m, scratch.l, scratch.acc, HD ** -0.5,
                                NH=NH, HD=HD, CHUNK=CHUNK, PER=per, NPART=nparts,
                                SOFTMAX=softmax, STAGES=args.stages, num_warps=warps)
                    report(f"{name}/{per}/w{warps}", loop)
        del kv, qkv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
