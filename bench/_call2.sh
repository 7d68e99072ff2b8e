#!/bin/bash
export HF_HUB_OFFLINE=1 PYTHONPATH=.
timeout 420 python3 -u bench/probe_cublaslt_algos.py --algos 48 --encode-ab --rounds 2 2>&1 | tail -40 | tee $OUT/lt.txt
python3 - <<'PY' 2>&1 | tee $OUT/gluon.txt
import triton; print("triton", triton.__version__)
try:
    import triton.experimental.gluon.language as gl
    import triton.experimental.gluon.language.nvidia.hopper as hp
    print("gluon hopper:", [n for n in dir(hp) if not n.startswith("_")])
    print("warp_specialize" in dir(gl))
except Exception as e:
    print("gluon missing:", repr(e))
PY
