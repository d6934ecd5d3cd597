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
python3 -m pytest -p no:xdist -m multi_gpu -q tests/test_tp.py

echo "== TP benchmark: Qwen3-8B shape, random weights =="
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/qwen3-8b"
cat > "$work/qwen3-8b/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
 "vocab_size": 151936, "tie_word_embeddings": false, "max_position_embeddings": 40960,
 "rope_theta": 1000000, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": false,
 "use_sliding_window": false, "torch_dtype": "bfloat16",
 "bos_token_id": 151643, "eos_token_id": 151645}
JSON

cat > "$work/tp_bench.py" <<'PY'
"""One benchmark run: python3 tp_bench.py MODEL_DIR TP RESULT_JSON (BENCH.md's GPU workload)."""
import json
import sys
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams


def workload():
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024))
              for _ in range(256)]
    return prompts, params


def main(model_dir: str, tp: int, result_path: str) -> None:
    prompts, params = workload()
    totals = (sum(map(len, prompts)), sum(p.max_tokens for p in params))
    if totals != (142827, 133966):
        raise SystemExit(f"workload totals {totals} differ from BENCH.md's (142827, 133966)")
    start = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096)
    load_s = time.perf_counter() - start
    llm.generate([list(range(100, 164))], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    llm.close()
    result = {"tp": tp, "load_s": load_s, "gen_s": gen_s, "out_tokens": out_tokens,
              "tok_s": out_tokens / gen_s, "kv_blocks": stats["num_kv_blocks"],
              "preemptions": stats["preemptions"]}
    print(json.dumps(result), flush=True)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # spawned TP workers import this file: keep the run behind the guard
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
PY

for tp in 1 2; do
    python3 "$work/tp_bench.py" "$work/qwen3-8b" "$tp" "$work/tp$tp.json"
done

python3 - "$work" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/tp{tp}.json")) for tp in (1, 2)]
base = runs[0]["tok_s"]
print("\nQwen3-8B shape, random bf16 weights, 256 requests (142,827 prompt / 133,966 output tokens)")
print(f"{'TP':>3} {'load s':>7} {'generate s':>11} {'out tokens':>11} {'out tok/s':>10} "
      f"{'KV blocks':>10} {'preempt':>8} {'vs TP=1':>8}")
for r in runs:
    print(f"{r['tp']:>3} {r['load_s']:>7.1f} {r['gen_s']:>11.2f} {r['out_tokens']:>11,} "
          f"{r['tok_s']:>10,.0f} {r['kv_blocks']:>10,} {r['preemptions']:>8} {r['tok_s'] / base:>7.2f}x")
PY
