#!/usr/bin/env bash
# The H200 lent by the device tool runs Triton 3.6; this machine's venv has 3.9, and 3.6 has
# refused code that 3.9 compiles (session 23: a jit function's str default, a layout pass at
# a launch argument specialized to 1 - each found only on the GPU, at the price of device
# time). This builds the project's Triton code for sm_90 with Triton 3.6, on the CPU (the
# bundled ptxas; nothing runs): the fused launches of Gemma 4 and Qwen 3.5 (bench/
# compile_sm90.py), the Moondream 2 megakernel's "on" build, and the hybrid megakernel at
# Qwen 3.5's and Gemma 4's shapes (default + pre builds, b=1 / 8, and one build per integer
# argument = 1). Run it before a device session after touching kernels. Exit 1 on a failure.
#   bash scripts/check_triton36.sh        (first run: pip installs triton 3.6 into .triton36/)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
T36=${PHOTON_TRITON36:-.triton36}
if [ ! -f "$T36/triton/__init__.py" ]; then
  "$PY" -m pip install -q --no-deps --target "$T36" triton==3.6.0
fi
export PYTHONPATH="$T36:$PWD"
unset TRITON_INTERPRET
"$PY" -c "import triton, sys; v = triton.__version__; print('triton', v); sys.exit(v != '3.6.0')"
fail=0
run() {  # a command; its output into $log; a line "FAILED" / a non-zero exit marks a failure
  local log; log=$(mktemp)
  if "$@" >"$log" 2>&1 && ! grep -q "FAILED" "$log"; then
    grep -E "^(hybrid megakernel|megakernel b=|limit )" "$log" | cut -c1-160 || true
  else
    echo "FAILED: $*"; grep -vE "^ *[%#^}]|loc\(" "$log" | tail -30; fail=1
  fi
  rm -f "$log"
}
run "$PY" bench/compile_sm90.py --what gemma4,qwen3_5 --layers 10 --kv-shared 4 --b 1,4
run "$PY" bench/compile_megakernel.py --b 1 \
    --variants "$("$PY" -c 'from photon_core.megakernel.megakernel_backend import BEST; print(BEST)')"
for fam in qwen3.5 gemma4; do
  run "$PY" bench/compile_megakernel.py --hybrid "$fam" --b 1,8 --ones \
      --variants auto/w8/s3,pipe_fma@8x1024/w8/s3/pre/red
done
exit $fail
