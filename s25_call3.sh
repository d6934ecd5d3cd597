#!/usr/bin/env bash
# session 25, call 3: the decode kernel's hardware counters (ncu), then the GPU kernel tests again
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s); LIMIT=${S25_LIMIT:-400}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
L=$OUT/call3.log
log() { echo "=== $* $(date -u +%H:%M:%S) (at $(( $(date +%s) - T0 )) s)" >> $L; }
date -u >> $L; nvidia-smi -L >> $L; echo "commit ${NANOVLLM_COMMIT:-?}" >> $L; uname -r >> $L
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" >> $L; $NCU --version >> $L 2>&1
for spec in "fp8 129" "bf16 129" "fp8 129 3" "fp8 256"; do
  set -- $spec; kv=$1; b=$2; wide=${3:-}
  [ $(left) -gt 60 ] || break
  tag="$kv-b$b${wide:+-wide$wide}"
  log "plain $tag"
  timeout 60 python3 scripts/ncu_decode.py --kv $kv --batch $b ${wide:+--wide $wide} >> $L 2>&1
  log "ncu $tag"
  timeout $(( $(left) - 10 )) $NCU --clock-control none --kernel-name regex:_decode_kernel --launch-skip 5 --launch-count 1 \
     --set full --import-source no python3 scripts/ncu_decode.py --kv $kv --batch $b ${wide:+--wide $wide} --launches 8 \
     > $OUT/ncu-$tag.txt 2>&1
  echo "rc $? lines $(wc -l < $OUT/ncu-$tag.txt)" >> $L
done
if [ $(left) -gt 100 ]; then
  log "pytest tests/gpu -n auto"; python3 -m pip install -q --no-index --find-links .whl gguf fastapi uvicorn httptools openai >> $L 2>&1
  timeout $(( $(left) - 5 )) python3 -m pytest -n auto -q -p no:cacheprovider tests/gpu -x 2>&1 | tail -5 >> $L
fi
log end
