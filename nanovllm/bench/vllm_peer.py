"""Runs inside vLLM's own virtual environment (see peers.run_vllm): reads the workload as JSON
on stdin, prints one JSON line of measurements. Imports nothing from nanovllm."""

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        enable_prefix_caching=True,
        seed=0,
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.9),
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=job["temperature"], max_tokens=n, ignore_eos=True) for n in job["max_tokens"]]
    warm = [TokensPrompt(prompt_token_ids=[(t + 1) % 30000 for t in p[:32]]) for p in job["prompts"][:2]]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    import vllm

    results = []
    labels = [f"vLLM {vllm.__version__} (cold prefix cache)"]
    if job.get("warm_repeat"):
        labels.append(f"vLLM {vllm.__version__} (prefix cache warm)")
    for label in labels:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        results.append(
            {"engine": label, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": elapsed}
        )
    print(json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
