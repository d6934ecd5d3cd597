#!/usr/bin/env bash
# GPU CI: what a GPU CI job runs on a machine with the GPU image (python with a CUDA build of torch
# and Triton). From the repository root:   bash scripts/gpu_ci.sh
#
#   1. installs the test dependencies the image lacks: from the wheels in $NANOVLLM_WHEELS (default
#      ./.whl) when that folder exists, else from the package index (no other network);
#   2. warms Triton's kernel cache once (scripts/warm_triton.py);
#   3. the whole suite: pytest -n auto (every test; GPU checks included; CPU runs stay);
#   4. the conformance suite on CUDA, with its report (python -m conformance --device cuda);
#   5. the mutant table on CUDA (every mutant that applies there must be caught).
# Time limits per phase (seconds): NANOVLLM_GPU_CI_LIMITS="warm pytest conformance mutants",
# default "150 330 150 240" (the whole job within about 15 minutes; the target is 8). A limit of 0
# skips its phase (reported as skipped, and the job fails unless NANOVLLM_GPU_CI_ALLOW_SKIP=1).
#
# Logs and reports go to $OUT (or ./gpu_ci_logs); a summary is printed last. Exit status 0 only
# when all three runs pass. The summary names the commit: $NANOVLLM_COMMIT, else `git rev-parse`
# here (set it where the tree was copied without its current git metadata: that names another).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="${OUT:-gpu_ci_logs}"
PY="${PYTHON:-python3}"
WHEELS="${NANOVLLM_WHEELS:-.whl}"
JOBS="${NANOVLLM_GPU_CI_JOBS:-$(nproc)}"   # conformance and mutant processes
read -r L_WARM L_PYTEST L_CONF L_MUT <<< "${NANOVLLM_GPU_CI_LIMITS:-150 330 150 240}"
mkdir -p "$LOG"
t0=$(date +%s)
# phase LIMIT CMD...: run CMD under the limit; a limit of 0 skips it (exit status 3, "skipped")
phase() {
    local limit=$1; shift
    if [ "$limit" = 0 ]; then echo "skipped: its time limit is 0 (NANOVLLM_GPU_CI_LIMITS)"; return 3; fi
    timeout "$limit" "$@"
}

# ------------------------------------------------------------------ 1. environment, dependencies
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; echo "${NANOVLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"; nvidia-smi -L
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '| transformers', __import__('transformers').__version__, '| GPUs', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
} > "$LOG/env.txt" 2>&1
# what the test suite imports beyond the image (module -> distribution)
missing_deps() { "$PY" - <<'EOF'
import importlib.util
deps = {"gguf": "gguf", "hypothesis": "hypothesis", "xdist": "pytest-xdist", "fastapi": "fastapi",
        "uvicorn": "uvicorn", "uvloop": "uvloop", "httptools": "httptools", "openai": "openai", "httpx": "httpx", "aiohttp": "aiohttp", "prometheus_client": "prometheus-client",
        "matplotlib": "matplotlib"}
print(" ".join(dist for mod, dist in deps.items() if importlib.util.find_spec(mod) is None))
EOF
}
need=$(missing_deps)
if [ -n "$need" ]; then
    if [ -d "$WHEELS" ]; then   # offline: the wheels (and their missing dependencies) in $WHEELS
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" $need >> "$LOG/env.txt" 2>&1
    else
        "$PY" -m pip install -q $need >> "$LOG/env.txt" 2>&1
    fi || echo "pip install failed: $need" >> "$LOG/env.txt"
fi
left=$(missing_deps)
if [ -n "$left" ]; then   # the run goes on (the rest is still worth seeing) but says why tests fail
    echo "MISSING test dependencies (not installed: no wheels in $WHEELS and no package index): $left" >> "$LOG/env.txt"
else
    echo "installed: ${need:-nothing}" >> "$LOG/env.txt"
fi

timeout "$L_WARM" "$PY" scripts/warm_triton.py --jobs "${NANOVLLM_WARM_JOBS:-8}" >> "$LOG/env.txt" 2>&1

tw=$(date +%s)

# ------------------------------------------------------------------ 3. the whole suite
# a test that hangs is stopped (with every thread's stack in the log) instead of stalling the job
per_test=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${NANOVLLM_TEST_TIMEOUT:-240}")
phase "$L_PYTEST" "$PY" -m pytest -n auto -v -rfEs -p no:cacheprovider --durations=25 $per_test \
    --junitxml="$LOG/pytest.xml" > "$LOG/pytest.log" 2>&1
rc_pytest=$?
t1=$(date +%s)

# ------------------------------------------------------------------ 4. conformance on CUDA
phase "$L_CONF" "$PY" -m conformance --engine nanovllm --device cuda --report "$LOG/conformance-cuda.md" \
    -n "$JOBS" > "$LOG/conformance.log" 2>&1
rc_conf=$?
t2=$(date +%s)

# ------------------------------------------------------------------ 5. mutant table on CUDA
phase "$L_MUT" "$PY" -m tests.mutants.runner --device cuda --jobs "$JOBS" --markdown "$LOG/mutants-cuda.md" \
    > "$LOG/mutants.log" 2>&1
rc_mut=$?
t3=$(date +%s)

# ------------------------------------------------------------------ summary (also in $LOG/gpu_ci_summary.txt)
{
echo "=== GPU CI, $(head -1 "$LOG/env.txt"), commit $(sed -n 2p "$LOG/env.txt") ==="
sed -n '3,$p' "$LOG/env.txt" | grep -E "^(GPU|python|installed|MISSING|warmed)" | head -6
echo "--- warm-up $((tw - t0)) s; pytest -n auto (rc=$rc_pytest, $((t1 - tw)) s, $(grep -m1 -oE "[0-9]+ workers" "$LOG/pytest.log")) ---"
grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$LOG/pytest.log" | sort -u | head -30
echo "tests finished: $(grep -cE " (PASSED|FAILED|ERROR|SKIPPED) " "$LOG/pytest.log")"
echo "skips by reason:"   # pytest -rs groups equal skips as "SKIPPED [N] file:line: reason"
grep -E "^SKIPPED" "$LOG/pytest.log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]+(:[0-9]+)?: /\1 /' \
    | awk '{n = $1; $1 = ""; count[$0] += n} END {for (r in count) printf "%7d%s\n", count[r], r}' | sort -rn | head -12
tail -1 "$LOG/pytest.log"
echo "--- conformance --device cuda (rc=$rc_conf, $((t2 - t1)) s) ---"
grep -E "^- result:" "$LOG/conformance-cuda.md" 2>/dev/null || tail -5 "$LOG/conformance.log"
echo "--- mutant table, cuda (rc=$rc_mut, $((t3 - t2)) s) ---"
tail -1 "$LOG/mutants.log"
echo "--- wall time $((t3 - t0)) s ---"
} | tee "$LOG/gpu_ci_summary.txt"
ok() { [ "$1" = 0 ] || { [ "$1" = 3 ] && [ "${NANOVLLM_GPU_CI_ALLOW_SKIP:-0}" = 1 ]; }; }
ok $rc_pytest && ok $rc_conf && ok $rc_mut
