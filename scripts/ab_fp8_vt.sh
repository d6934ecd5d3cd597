#!/usr/bin/env bash
# The next GPU measurement of the FP8 cache's transposed V (KERNEL_NOTES session 20), one device call
# (~8 minutes on an H100 or H200), from the repository root:  OUT=<folder> bash scripts/ab_fp8_vt.sh
#   1. its GPU tests (the decode, prefill, store and q/k kernels with V transposed; the engine's tokens
#      and logprobs with and without it);
#   2. where a prefill step's time goes with the switch off and on (profile_gpu.py --skip 0, FP8);
#   3. the engine, fresh processes alternated twice: ab_engine.py new,vt=0 against new,vt=1,
#      bench --workload gpu --repeat 2 --kv-cache-dtype fp8.
# NANOVLLM_AB_TESTS=0 skips step 1 (where GPU CI runs them in the same session).
# Everything goes to $OUT/fp8_vt.tgz (packed after each step), the order of events also to stdout.
set -u
: "${OUT:?set OUT to the folder the results go to}"
W=$(mktemp -d)
pack() { tar czf "$OUT/fp8_vt.tgz" -C "$W" . ; }
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${NANOVLLM_AB_LIMIT:-480}  # seconds for the whole script; the A/B stops before a process would pass it
t0=$(date +%s)
{ date -u; nvidia-smi -L; git rev-parse --short HEAD 2>/dev/null; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$W/env.txt" 2>&1
[ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl hypothesis pytest-xdist gguf >> "$W/env.txt" 2>&1
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # without pytest-xdist: one process
[ "${NANOVLLM_AB_TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider $XDIST tests/gpu/test_triton_kernels.py tests/gpu/test_triton_fp8.py \
    tests/gpu/test_fused_ops.py tests/gpu/test_kv_cache_fp8_gpu.py -k "transposed or fp8" > "$W/tests.log" 2>&1
echo "tests rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 "$W/tests.log")" >> "$W/order.txt"; pack
for vt in 0 1; do
  NANOVLLM_FP8_V_TRANSPOSED=$vt timeout 90 python3 scripts/profile_gpu.py --skip 0 --steps 9 --kv-cache-dtype fp8 \
      > "$W/prefill-vt$vt.txt" 2>&1
  echo "prefill profile vt=$vt rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 "$W/prefill-vt$vt.txt")" >> "$W/order.txt"; pack
done
runs=4
for i in 1 2; do
  for vt in 0 1; do
    left=$(( LIMIT - ($(date +%s) - t0) ))
    [ $left -lt 50 ] && { echo "stop: $left s left" >> "$W/order.txt"; pack; cat "$W/order.txt"; exit 0; }
    share=$(( left / runs )); runs=$(( runs - 1 ))  # each process an equal share of what is left
    [ $share -lt 50 ] && share=$left
    timeout $share python3 scripts/ab_engine.py "new,vt=$vt" bench --workload gpu --repeat 2 --kv-cache-dtype fp8 \
        --json-out "$W/vt$vt-$i.json" > "$W/vt$vt-$i.log" 2>&1
    echo "vt=$vt-$i rc $? at $(( $(date +%s) - t0 )) s: $(grep -h 'run [12]:' "$W/vt$vt-$i.log" | tr '\n' ' ')" >> "$W/order.txt"; pack
  done
done
cat "$W/order.txt"
