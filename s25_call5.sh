#!/usr/bin/env bash
# session 25, call 5: FP8 decode occupancy (registers capped at 128: 4 CTAs per SM), kernel then engine
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s); LIMIT=${S25_LIMIT:-280}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
L=$OUT/call5.log
log() { echo "=== $* $(date -u +%H:%M:%S) (at $(( $(date +%s) - T0 )) s)" >> $L; }
date -u >> $L; nvidia-smi -L >> $L; echo "commit ${NANOVLLM_COMMIT:-?}" >> $L
log "kernel sweep"
timeout 120 python3 scripts/ncu_decode.py --kv fp8 --batch 64,129,256 \
  --tile shipped,128x4x3x128,64x4x5x128,64x4x3,128x4x5x128 >> $L 2>&1
best=$(grep "^best tile" $L | awk '{print $3}')
echo "best: $best" >> $L
if [ -n "$best" ] && [ "$best" != shipped ]; then
  for r in 1 2; do
    for v in new "new,fp8tile=$best"; do
      [ $(left) -gt 45 ] || break 2
      log "ab $v fp8"
      timeout $(( $(left) - 5 )) python3 scripts/ab_engine.py $v bench --workload gpu --repeat 2 --kv-cache-dtype fp8 2>&1 | grep -E "run [12]:|Error" >> $L
    done
  done
fi
log end
