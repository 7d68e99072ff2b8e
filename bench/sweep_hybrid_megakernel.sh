#!/usr/bin/env bash
# Hybrid-megakernel measurements on the H200, in parts (each under its own time limit; logs
# and JSON under $OUT, one folder per part): "tests" the GPU diff tests of the Qwen 3.5 /
# Gemma 4 megakernel engines at two variants (~3 min); "b1" / "b8" bench/ab_switch.py's graph-replay steps
# of variants against the fused step of the same process - b=1 FMA tiles, pre (~3 min) and b=8 tl.dot tiles (~2.5 min); "trace" bench/trace_hybrid_megakernel.py (where
# the step's time goes, ~2 min). A device call runs at most 10 min: two calls, e.g.
#   bash bench/sweep_hybrid_megakernel.sh tests b1      then      ... b8 trace
# "stages" (~4 min): b=1 pipeline depths (GST - 1 weight tiles in flight per program) and tile
# shapes; "b8g" Gemma 4 alone at b=8 (the b8 part's 150 s end before it).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
OUT=${OUT:-out}
part() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" timeout "$secs" "$@" >"$OUT/$name/log.txt" 2>&1
  echo "== $name: exit $?"
  grep -E "passed|failed|megakernel (in use|off)|->|Error|makespan|per program|  [a-z_]+ +n |straggler" \
      "$OUT/$name/log.txt" | cut -c1-240
}
PARTS="$*"
want() { [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
want tests && part tests 280 python3 -m pytest -q -p no:cacheprovider test/core/test_megakernel_engine.py \
    -k "gpu_qwen35_hybrid or gpu_gemma4_hybrid"
want b1 && part b1 210 python3 -u bench/ab_switch.py --families qwen3.5-0.8b,gemma4-e2b --toggle none \
    --batches 1 --rounds 2 --top 6 --option megakernel=auto/w8/s3 \
    --option megakernel=pipe_fma@8x1024/w8/s3/pre
want b8 && part b8 150 python3 -u bench/ab_switch.py --families qwen3.5-0.8b,gemma4-e2b --toggle none \
    --batches 8 --rounds 2 --option megakernel=pipe@16x512/w8/s3 \
    --option megakernel=pipe@16x512/w8/s3/pre
want stages && part stages 300 python3 -u bench/ab_switch.py --families qwen3.5-0.8b,gemma4-e2b \
    --toggle none --batches 1 --rounds 2 --top 0 --option megakernel=pipe_fma@8x1024/w8/s5/pre \
    --option megakernel=pipe_fma@8x1024/w8/s7/pre --option megakernel=pipe_fma@8x512/w8/s8/pre \
    --option megakernel=pipe_fma@16x512/w8/s6/pre
want b8g && part b8g 150 python3 -u bench/ab_switch.py --families gemma4-e2b --toggle none \
    --batches 8 --rounds 2 --top 0 --option megakernel=pipe@16x512/w8/s3/pre \
    --option megakernel=pipe@16x512/w8/s5/pre
want trace && part trace 170 python3 -u bench/trace_hybrid_megakernel.py \
    --families qwen3.5-0.8b,gemma4-e2b --variant pipe_fma@8x1024/w8/s3/pre/red
exit 0
