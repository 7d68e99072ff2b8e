#!/usr/bin/env bash
# One device call's worth of hybrid-megakernel measurements (H200, ~8 min): the GPU diff
# tests of the Qwen 3.5 / Gemma 4 megakernel engines, then bench/ab_switch.py's graph-replay
# steps of variants against the fused step of the same process - b=1 (FMA tiles, pre, L2
# prefetch) and b=8 (tl.dot tiles). Each part under its own time limit; logs and JSON under
# $OUT (one folder per part). Usage (device tool): bash bench/sweep_hybrid_megakernel.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
OUT=${OUT:-out}
part() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" timeout "$secs" "$@" >"$OUT/$name/log.txt" 2>&1
  echo "== $name: exit $?"
  grep -E "passed|failed|megakernel (in use|off)|->|Error" "$OUT/$name/log.txt" | cut -c1-240
}
part tests 150 python3 -m pytest -q -p no:cacheprovider test/core/test_megakernel_engine.py \
    -k "gpu_qwen35_hybrid or gpu_gemma4_hybrid"
part b1 210 python3 -u bench/ab_switch.py --families qwen3.5-0.8b,gemma4-e2b --toggle none \
    --batches 1 --rounds 2 --top 6 --option megakernel=auto/w8/s3 \
    --option megakernel=pipe_fma@8x1024/w8/s3/pre \
    --option megakernel=pipe_fma@8x1024/w8/s3/pre/pf32
part b8 150 python3 -u bench/ab_switch.py --families qwen3.5-0.8b,gemma4-e2b --toggle none \
    --batches 8 --rounds 2 --option megakernel=pipe@16x512/w8/s3 \
    --option megakernel=pipe@16x512/w8/s3/pre
