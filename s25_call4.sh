#!/usr/bin/env bash
# session 25, call 4: where the FP8 decode kernel's warps stall and which instructions conflict in shared memory
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s); LIMIT=${S25_LIMIT:-300}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
L=$OUT/call4.log
log() { echo "=== $* $(date -u +%H:%M:%S) (at $(( $(date +%s) - T0 )) s)" >> $L; }
date -u >> $L; nvidia-smi -L >> $L; echo "commit ${NANOVLLM_COMMIT:-?}" >> $L
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for spec in "fp8 129" "bf16 129" "fp8 256"; do
  set -- $spec; kv=$1; b=$2; tag="$kv-b$b"
  [ $(left) -gt 50 ] || break
  log "plain $tag"; timeout 60 python3 scripts/ncu_decode.py --kv $kv --batch $b >> $L 2>&1
  log "ncu $tag"
  timeout $(( $(left) - 10 )) $NCU --clock-control none --kernel-name regex:_decode_kernel --launch-skip 5 --launch-count 1 \
     --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis_Tables -f -o $OUT/$tag \
     python3 scripts/ncu_decode.py --kv $kv --batch $b --launches 2 >> $L 2>&1
  $NCU -i $OUT/$tag.ncu-rep --page raw --csv > $OUT/raw-$tag.csv 2>> $L
  [ $kv = fp8 ] && [ $b = 129 ] && $NCU -i $OUT/$tag.ncu-rep --page source --print-source sass --csv > $OUT/sass-$tag.csv 2>> $L
  rm -f $OUT/$tag.ncu-rep
done
cd $OUT && ls -la >> $L && gzip -9 *.csv
log end
