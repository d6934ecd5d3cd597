#!/usr/bin/env bash
# One GPU call for issue 4: the GPU tests, then the kernel/engine micro-benchmarks.
# Run from anywhere with the image's python3:   bash scripts/gpu_check.sh
# Full logs go to $OUT (or ./gpu_logs); a short summary table is printed last.
# Budget: tests <= 150 s, benchmarks <= 180 s (each under `timeout`).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
LOG="${OUT:-gpu_logs}"
mkdir -p "$LOG"
PY="${PYTHON:-python3}"
start=$(date +%s)

{ nvidia-smi; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$LOG/env.txt" 2>&1

timeout 150 "$PY" -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/gpu > "$LOG/pytest_gpu.log" 2>&1
rc_tests=$?
tests_done=$(date +%s)

timeout 180 "$PY" scripts/bench_kernels.py --engine --json "$LOG/bench.json" > "$LOG/bench.log" 2>&1
rc_bench=$?
end=$(date +%s)

echo "=== GPU tests (rc=$rc_tests, $((tests_done - start)) s; full log: $LOG/pytest_gpu.log) ==="
grep -E "^(FAILED|ERROR)" "$LOG/pytest_gpu.log" | head -20
tail -3 "$LOG/pytest_gpu.log"
echo "=== benchmarks (rc=$rc_bench, $((end - tests_done)) s; full log: $LOG/bench.log) ==="
if grep -q "^| what" "$LOG/bench.log"; then
    sed -n '/^| what/,$p' "$LOG/bench.log"
else
    tail -30 "$LOG/bench.log"
fi
exit $(( rc_tests != 0 || rc_bench != 0 ))
