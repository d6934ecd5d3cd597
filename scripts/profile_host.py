"""Where the host's time goes in the standard GPU run's first steps (the prefill phase):
cProfile over ``LLMEngine.step`` calls FIRST..LAST of the workload (bench warm-up first).

    PYTHONPATH=. python3 scripts/profile_host.py [--first 1] [--last 18] [--top 35]

Prints the functions by own time and by cumulative time; a blocking call (an event or stream
synchronisation, a device-to-host read) shows up as own time of that call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.bench.peers import _warmup_prompts
from nanovllm.bench.workloads import gpu_workload, shape_config_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--last", type=int, default=18)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    w = gpu_workload()
    llm = LLM(shape_config_dir("qwen3-0.6b"), load_format="dummy", max_model_len=4096)
    engine = llm.llm_engine
    llm.generate(_warmup_prompts(w), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = torch.cuda.memory_stats()
    prof = cProfile.Profile()
    step, count = engine.step, [0]

    def profiled_step():
        count[0] += 1
        if args.first <= count[0] <= args.last:
            t = time.perf_counter()
            prof.enable()
            try:
                return step()
            finally:
                prof.disable()
                print(f"step {count[0]}: {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
        return step()

    engine.step = profiled_step  # type: ignore[method-assign]
    params = [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(w.prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"run: {time.perf_counter() - t:.2f} s, {count[0]} steps")
    after = torch.cuda.memory_stats()
    # device allocations and frees (cudaFree synchronises the device), allocator retries
    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"):
        print(f"{key}: {after.get(key, 0) - before.get(key, 0)} during the run")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    llm.close()


if __name__ == "__main__":
    main()
