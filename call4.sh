#!/usr/bin/env bash
# session 10, GPU call 4 (temporary; not committed): GPU CI on 9384395, then bf16 vs FP8 side by side
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R/ci
save() { tar czf $OUT/r.tgz -C $R . ; }
NANOVLLM_COMMIT=9384395 OUT=$R/ci NANOVLLM_GPU_CI_LIMITS="70 200 45 190" bash scripts/gpu_ci.sh > $R/ci-summary.txt 2>&1; echo "rc $?" >> $R/ci-summary.txt; save
timeout 80 python3 -m nanovllm.entrypoints.cli bench --workload gpu --repeat 2 --peer nanovllm:kv_cache_dtype=fp8 --json-out $R/bench-fp8.json > $R/bench-fp8.log 2>&1; save
