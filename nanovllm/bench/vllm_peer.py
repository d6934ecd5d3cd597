"""Runs inside vLLM's own virtual environment (see peers.run_vllm): reads the workload as JSON
on stdin, prints one JSON line of measurements. Imports nothing from nanovllm."""

import json
import statistics
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

    def timed() -> dict:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return {"output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": elapsed}

    repeat = int(job.get("repeat", 1))
    cold = []
    for _ in range(repeat):  # each cold run after a prefix-cache reset: none reuses the last one's blocks
        llm.reset_prefix_cache()
        cold.append(timed())
    if len({r["output_tokens"] for r in cold}) != 1:
        raise RuntimeError(f"vLLM's cold runs generated different token counts: {[r['output_tokens'] for r in cold]}")
    seconds = [r["seconds"] for r in cold]
    row = {"engine": f"vLLM {vllm.__version__} (cold prefix cache)", "output_tokens": cold[0]["output_tokens"]}
    row.update(seconds=statistics.median(seconds), runs=seconds, note=f"median of {repeat}" if repeat > 1 else "")
    results = [row]
    if job.get("warm_repeat"):  # the same prompts again, right after the last cold run
        results.append({"engine": f"vLLM {vllm.__version__} (prefix cache warm)", **timed()})
    print(json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
