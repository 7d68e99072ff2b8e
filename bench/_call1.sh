#!/bin/bash
# session 42 call 1 (untracked): the TMA vision / prefix attention vs cuDNN, then the encode A/B
export HF_HUB_OFFLINE=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv | tee $OUT/smi.txt
C="128x64x4x3"
for c in 64x64x4x2 64x64x4x3 64x128x4x2 128x64x4x3 128x64x8x2 128x64x8x3 128x128x8x2 128x32x4x3; do C="$C,${c}x1x0"; done
for c in 64x64x4x3 128x64x8x3 128x128x8x2; do C="$C,${c}x1x1"; done
timeout 240 python3 -u bench/bench_vision_attention.py --configs $C --prefix-configs 64x64x4x2,64x64x4x3,128x64x8x2,128x64x4x3,128x128x8x2 2>&1 | tee $OUT/bva.txt
read BEST PBEST < <(python3 - <<'PY'
import json,os
j=json.load(open(os.environ["OUT"]+"/bench_vision_attention.json"))
def best(r):
    ok={k:v for k,v in r.items() if "ms_per_encode" in v and k!="sdpa" and v["rel_diff_vs_fp32"]<0.02}
    return min(ok,key=lambda k:ok[k]["ms_per_encode"])
print(best(j["rows"]), best(j["prefix"]["frames1"]))
PY
)
echo "best: $BEST prefix: $PBEST" | tee -a $OUT/bva.txt
VF=photon_core.models.moondream2.vision_fused:ATTENTION
PF=photon_core.models.moondream2.prefix_prefill:FUSED_ATTENTION
SETS=(--set "$VF=triton:$BEST" --toggle "$VF=sdpa")
SLOWER=$(python3 -c "import json,os;j=json.load(open(os.environ['OUT']+'/bench_vision_attention.json'))['prefix']['frames1'];print(int(j['$PBEST']['ms_per_encode']>=j['sdpa']['ms_per_encode']))")
[ "$SLOWER" = 0 ] && SETS+=(--set "$PF=triton:$PBEST" --toggle "$PF=sdpa")
echo "${SETS[@]}" | tee -a $OUT/bva.txt
timeout 200 python3 -u bench/ab_encode.py --family moondream2 --rounds 2 --iters 10 "${SETS[@]}" 2>&1 | tail -30 | tee $OUT/abenc.txt
