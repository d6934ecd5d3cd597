#!/usr/bin/env bash
# Tensor-parallel check on a machine with two GPUs (issue 5), in one run:
#   1. tests/test_tp.py's and tests/test_tp_async.py's multi_gpu tests: TP=2 vs TP=1 over NCCL
#      with CUDA graphs on (async scheduling, the CUDA default), and TP=2 async vs sync;
#   2. the TP benchmark: Qwen3-8B shape, random weights (load_format="dummy"), the GPU
#      standard GPU workload, TP=1, TP=2 (async scheduling, the default) and TP=2 with
#      --no-async-scheduling (each in a fresh process), a table last.
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
python3 -m pytest -p no:xdist -m multi_gpu -q tests/test_tp.py tests/test_tp_async.py || echo "TP TESTS FAILED"

echo "== multi_gpu conformance check (TP=2 vs TP=1 over NCCL) =="
python3 -m pytest -p no:xdist -m multi_gpu -q conformance/test_tensor_parallel.py || echo "TP CONFORMANCE FAILED"

echo "== TP benchmark: Qwen3-8B shape, random weights, standard GPU workload =="
for run in "1 tp1" "2 tp2" "2 tp2_sync --no-async-scheduling"; do
    set -- $run
    python3 -m nanovllm.entrypoints.cli bench --workload gpu --shape qwen3-8b --tensor-parallel-size "$1" --repeat 2 \
        "${@:3}" --json-out "${OUT:-/tmp}/bench_$2.json" 2>&1 | grep -v "it/s]"
done
python3 - "${OUT:-/tmp}" <<'PY'
import json, sys
tps = {name: json.load(open(f"{sys.argv[1]}/bench_{name}.json"))["results"][0]["tokens_per_s"]
       for name in ("tp1", "tp2", "tp2_sync")}
print(f"\nQwen3-8B shape: TP=1 {tps['tp1']:,.0f} tok/s, TP=2 async {tps['tp2']:,.0f} tok/s, "
      f"TP=2 sync {tps['tp2_sync']:,.0f} tok/s; TP=2 / TP=1 = {tps['tp2'] / tps['tp1']:.2f}x, "
      f"async / sync at TP=2 = {tps['tp2'] / tps['tp2_sync']:.2f}x")
PY
