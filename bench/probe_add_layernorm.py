"""The residual add + LayerNorm kernel (ops/add_layernorm.py) at the encode's shapes, rows
per program by rows per program: us per call and GB/s of its traffic (x, t read; s, h
written) against the device's copy bandwidth, every form's output checked against the
reference. The vision tower calls it 54 times per 9-crop encode at [6561, 1152], the image
prefill 24 times at [730, 2048] (with t_bias).

Usage (GPU): PYTHONPATH=. python3 bench/probe_add_layernorm.py [--forms 1x0,2x4,4x4,4x8,8x8]
    (ROWSxWARPS; WARPS 0: the op's default). Writes $OUT/probe_add_layernorm.json when OUT
    is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from photon_core.ops import add_layernorm as AL  # noqa: E402


def main():
    from bench.bench_timing import copy_bandwidth, graph_ms
    from bench.out_dir import write_json
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="1x0,2x4,4x4,4x8,8x8,16x8")
    args = ap.parse_args()
    copy = copy_bandwidth("cuda") / 1e9
    out = {"gpu": torch.cuda.get_device_name(), "copy_gbs": round(copy, 1), "shapes": {}}
    print(out, flush=True)
    g = torch.Generator("cuda").manual_seed(0)
    for rows, d, bias in ((6561, 1152, False), (730, 2048, True)):
        # 4 sets of inputs taken in turn (~240 MB at the vision shape: each call's reads come
        # from HBM, as in the encode, not from the 50 MB L2)
        sets = [[torch.randn(rows, d, device="cuda", generator=g).bfloat16() for _ in range(2)]
                for _ in range(4)]
        x, t = sets[0]
        w, b, tb = (torch.randn(d, device="cuda", generator=g).bfloat16() for _ in range(3))
        tb = tb if bias else None
        s_ref, h_ref = AL.add_layernorm_reference(x, t, w, b, t_bias=tb)
        gb = 4 * x.numel() * x.element_size() / 1e9
        res = {}
        for form in args.forms.split(","):
            r, wp = (int(v) for v in form.split("x"))
            AL.ROWS, AL.WARPS = r, wp
            try:
                s, h = AL.add_layernorm(x, t, w, b, t_bias=tb)
                turn = [0]

                def call():
                    turn[0] += 1
                    return AL.add_layernorm(*sets[turn[0] % 4], w, b, t_bias=tb)
                us = graph_ms(call, calls=54) * 1e3
                res[form] = {"us": round(us, 2), "gbs": round(gb / us * 1e6, 1),
                             "of_copy": round(gb / us * 1e6 / copy, 3),
                             "s_equal": bool(torch.equal(s, s_ref)),
                             "h_max_diff": round((h.float() - h_ref.float()).abs().max().item(), 5)}
            except Exception as e:  # noqa: BLE001
                res[form] = {"error": repr(e)[:300]}
            print((rows, d), form, res[form], flush=True)
        AL.ROWS, AL.WARPS = 1, 0
        out["shapes"][f"{rows}x{d}"] = res
    write_json("probe_add_layernorm.json", out)


if __name__ == "__main__":
    main()
