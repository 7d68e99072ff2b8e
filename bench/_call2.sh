#!/bin/bash
export HF_HUB_OFFLINE=1 PYTHONPATH=.
python3 - <<'PY' 2>&1 | tee $OUT/gluon.txt
import triton; print("triton", triton.__version__)
try:
    import triton.experimental.gluon as g
    import triton.experimental.gluon.language as gl
    print("gluon ok", [n for n in dir(gl) if not n.startswith("_")][:80])
    import triton.experimental.gluon.language.nvidia.hopper as hp
    print("hopper", [n for n in dir(hp) if not n.startswith("_")])
    import triton.experimental.gluon.language.nvidia.hopper.tma as tma
    print("tma", [n for n in dir(tma) if not n.startswith("_")])
    print("warp_specialize" in dir(gl))
except Exception as e:
    print("gluon missing:", repr(e))
PY
timeout 200 python3 -u bench/encode_graph_top.py --top 40 2>&1 | tail -60 | tee $OUT/egt.txt
