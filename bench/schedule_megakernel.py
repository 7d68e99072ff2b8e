"""The megakernel's placement at Moondream 2's shapes, on any machine (no GPU, no weights):
per variant and batch bucket, the instructions, the programs, the most instructions and the
most attention instructions one program runs, and the estimated makespan. The H200 run of
main e6a929d showed why it matters: with the plain earliest-free rule (the variants' former
"greedy", removed in session 39) one program ran 120 of the 3072 attention instructions at
b=1 (~7 us each), and "attention only" took 0.8 ms.

Usage: PYTHONPATH=. python3 bench/schedule_megakernel.py [--variants V,V] [--b 1,8]
       [--kv 832] [--n-sm 132]   (V: megakernel_step.Variant strings; SMs x its pN programs)
"""
from __future__ import annotations

import argparse
import collections
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_megakernel import moondream_shape  # noqa: E402


def placement(b: int, variant: str, kv: int, n_sm: int) -> dict:
    from photon_core.megakernel import compiler as C
    from photon_core.megakernel.instructions import OP_ATTN
    from photon_core.megakernel.lowering import ProgramLowering, gemv_configs
    from photon_core.megakernel.megakernel_step import Variant
    v = Variant.parse(variant)
    gemv = v.gemv if v.gemv != "auto" else ("fma" if b == 1 else "small")
    sh, dims = moondream_shape(b, kv)
    cfg = gemv_configs(b, **dims, gemv=gemv)
    w1 = types.SimpleNamespace(shape=(dims["n1"], dims["d"]))
    layer = dict(w1=dict(n_split=dims["n_split"], w=w1, gap=0), a_off=dims["n_split"],
                 res_off=dims["n_split"])
    from photon_core.moondream.config import MoondreamConfig
    n_layers = MoondreamConfig().text.n_layers
    low = types.SimpleNamespace(layers=[layer] * n_layers,
                                program=types.SimpleNamespace(dim=dims["d"]),
                                shape=dict(sh, ANSWER_ID=-1), head=False)
    ops = ProgramLowering._program(low, n_layers)      # the lowering's op list, no tensors
    if v.fill:                                         # (compile_program's steps)
        ops = C.fill_order(ops)
    n_sm *= v.per_sm
    ins = C.split_ops(ops, b, sh, cfg, n_sm, 2, v.attn_per or None, v.fill, v.per_sm, v.tail)
    makespan = C.schedule(ins, n_sm)
    per = collections.Counter(i.sm for i in ins)
    attn = collections.Counter(i.sm for i in ins if i.op == OP_ATTN)
    out = dict(instructions=len(ins), programs=len(per), max_per_program=max(per.values()),
               attn=sum(attn.values()), max_attn_per_program=max(attn.values()),
               est_makespan_us=round(makespan, 1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="pipe_fma@16x512/w8/s4,pipe@16x512/w4/s4")
    ap.add_argument("--b", default="1,8")
    ap.add_argument("--kv", type=int, default=832)
    ap.add_argument("--n-sm", type=int, default=132)
    args = ap.parse_args()
    for b in (int(x) for x in args.b.split(",")):
        for vs in args.variants.split(","):
            try:
                print(f"b={b} {vs}: {placement(b, vs, args.kv, args.n_sm)}", flush=True)
            except Exception as e:  # noqa: BLE001  (a GEMV shape that does not fit this b)
                print(f"b={b} {vs}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
