#!/usr/bin/env bash
# Session 16's GPU measurement of the preloading linear kernel (KERNEL_NOTES session 16), one device
# call (~8 minutes on an H200), from the repository root:  OUT=<folder> bash scripts/ab_preload.sh
#   1. its GPU tests (decode GEMM, PDL, fused ops);
#   2. the layer chain: ab_kernels.py --only gemm (cuBLAS, the strip kernel, preload configs);
#   3. the engine, fresh processes alternated twice: `new` against the chain's best preload config
#      (ab_engine.py new,pre=N,precfg=CFG,early=E), bench --workload gpu --repeat 2.
# Everything goes to $OUT/preload.tgz (packed after each step), the order of events also to stdout.
set -u
: "${OUT:?set OUT to the folder the results go to}"
W=$(mktemp -d)
pack() { tar czf "$OUT/preload.tgz" -C "$W" . ; }
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${NANOVLLM_AB_LIMIT:-480}  # seconds for the whole script; the A/B stops before a process would pass it
t0=$(date +%s)
{ date -u; nvidia-smi -L; git rev-parse --short HEAD 2>/dev/null; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$W/env.txt" 2>&1
[ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl hypothesis pytest-xdist gguf >> "$W/env.txt" 2>&1
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # without pytest-xdist: one process
timeout 150 python3 -m pytest -q -p no:cacheprovider $XDIST tests/gpu/test_decode_gemm.py tests/test_pdl.py \
    tests/gpu/test_pdl_gpu.py tests/gpu/test_fused_ops.py > "$W/tests.log" 2>&1
echo "tests rc $? at $(( $(date +%s) - t0 )) s" >> "$W/order.txt"; pack
timeout 120 python3 scripts/ab_kernels.py --only gemm > "$W/gemm.txt" 2>&1
echo "gemm rc $? at $(( $(date +%s) - t0 )) s" >> "$W/order.txt"; pack
line=$(grep "^best preload" "$W/gemm.txt")
spec=$(echo "$line" | awk '{print $3}'); rows=$(echo "$line" | sed -n 's/.*rows=\([0-9]*\).*/\1/p')
if [ -z "$spec" ] || [ "$spec" = none ]; then spec=pre32/16x16x8e; rows=64; fi  # the expected best
early=0; case "$spec" in *e) early=1; spec=${spec%e};; esac
PRE="new,pre=$rows,precfg=${spec#pre},early=$early"
echo "variant $PRE" >> "$W/order.txt"
runs=4
for i in 1 2; do
  for v in new "$PRE"; do
    tag=$([ "$v" = new ] && echo main || echo pre)
    left=$(( LIMIT - ($(date +%s) - t0) ))
    [ $left -lt 70 ] && { echo "stop: $left s left" >> "$W/order.txt"; pack; exit 0; }
    share=$(( left / runs )); runs=$(( runs - 1 ))  # each process an equal share of what is left
    [ $share -lt 70 ] && share=$left
    timeout $share python3 scripts/ab_engine.py "$v" bench --workload gpu --repeat 2 --json-out "$W/$tag-$i.json" > "$W/$tag-$i.log" 2>&1
    echo "$tag-$i rc $? at $(( $(date +%s) - t0 )) s: $(grep -h 'tok/s' "$W/$tag-$i.log" | tail -2 | tr '\n' ' ')" >> "$W/order.txt"; pack
  done
done
cat "$W/order.txt"
