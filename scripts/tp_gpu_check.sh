#!/usr/bin/env bash
# Tensor-parallel check on a machine with two GPUs (issue 5), in one run:
#   1. tests/test_tp.py's multi_gpu tests: TP=2 vs TP=1 over NCCL with CUDA graphs on;
#   2. the TP benchmark: Qwen3-8B shape, random weights (load_format="dummy"), the GPU
#      workload of design/BENCH.md, TP=1 then TP=2 (each in a fresh process), a table last.
# Run from the repository root:  bash scripts/tp_gpu_check.sh   (about 4-6 minutes)
set -euo pipefail

# NVLink multicast stays off (it can take a shared host's GPUs down); the TP workers are
# spawned from these processes and inherit this environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

python3 -c 'import torch; print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|",
            torch.cuda.device_count(), "x", torch.cuda.get_device_name(0))'

echo "== multi_gpu tests (NCCL, CUDA graphs) =="
python3 -m pytest -p no:xdist -m multi_gpu -q tests/test_tp.py || echo "TP TESTS FAILED"

echo "== multi_gpu conformance check (TP=2 vs TP=1 over NCCL) =="
python3 -m pytest -p no:xdist -m multi_gpu -q conformance/test_tensor_parallel.py || echo "TP CONFORMANCE FAILED"

echo "== TP benchmark: Qwen3-8B shape, random weights, BENCH.md GPU workload =="
for tp in 1 2; do
    python3 -m nanovllm.entrypoints.cli bench --workload gpu --shape qwen3-8b --tensor-parallel-size "$tp" --repeat 2 \
        --json-out "${OUT:-/tmp}/bench_tp$tp.json" 2>&1 | grep -v "it/s]"
done
python3 - "${OUT:-/tmp}" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/bench_tp{tp}.json")) for tp in (1, 2)]
tps = [r["results"][0]["tokens_per_s"] for r in runs]
print(f"\nQwen3-8B shape: TP=1 {tps[0]:,.0f} tok/s, TP=2 {tps[1]:,.0f} tok/s, TP=2 / TP=1 = {tps[1] / tps[0]:.2f}x")
PY
