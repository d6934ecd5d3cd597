#!/usr/bin/env bash
# session 25, call 1: measurements, adaptive to the time left (S25_LIMIT seconds from the start)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s); LIMIT=${S25_LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
L=$OUT/call1.log
log() { echo "=== $* $(date -u +%H:%M:%S) (at $(( $(date +%s) - T0 )) s)" >> $L; }
date -u >> $L; nvidia-smi -L >> $L; echo "commit ${NANOVLLM_COMMIT:-?}" >> $L
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
ab() { # variant rest...
  local v=$1; shift
  log "ab $v $*"
  timeout $(( $(left) - 5 )) python3 scripts/ab_engine.py $v bench --workload gpu --repeat 2 "$@" 2>&1 | grep -E "tok/s|Error|error" | grep -v "^INFO" >> $L
}
fp8_three() {
  for r in 1 2; do
    for v in new new,fp8tile=128x4x3 new,wide=3; do
      [ $(left) -gt 50 ] || return; ab $v --kv-cache-dtype fp8
    done
  done
}
head_bench() {
  [ $(left) -gt 100 ] || return
  log "bench HEAD bf16 + fp8 peer"
  timeout $(( $(left) - 5 )) python3 -m nanovllm.entrypoints.cli bench --workload gpu --repeat 2 --peer nanovllm:kv_cache_dtype=fp8 --json-out $OUT/bench.json > $OUT/bench.log 2>&1
  grep -E "tok/s|x |ratio|roofline|limit" $OUT/bench.log | tail -12 >> $L
}
if echo "$GPU" | grep -q H200; then
  head_bench
  [ $(left) -gt 80 ] && { log "phases runs 2"; timeout $(( $(left) - 5 )) python3 scripts/profile_phases.py --runs 2 --json-out $OUT/phases.json > $OUT/phases.log 2>&1; tail -25 $OUT/phases.log >> $L; }
  for r in 1 2; do for v in new new,waves=4; do [ $(left) -gt 50 ] && ab $v; done; done
  fp8_three
else
  fp8_three
  head_bench
fi
log "end"
