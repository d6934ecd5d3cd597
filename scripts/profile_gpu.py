"""Where a decode step's time goes on the GPU: torch.profiler over steady-state decode steps
of the standard GPU workload (Qwen3-0.6B shape, random weights).

    PYTHONPATH=. python3 scripts/profile_gpu.py [--steps 30] [--skip 200] [--kv-cache-dtype fp8]

Prints the kernels by total device time, the device-busy time per step and the
wall time per step (their difference is host time the GPU waited for).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.bench.workloads import gpu_workload, shape_config_dir
from nanovllm.sampling_params import RequestOutputKind


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=200, help="steps to run before profiling (past the prefill)")
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    w = gpu_workload()
    llm = LLM(shape_config_dir(args.shape), load_format="dummy", max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    for i, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        engine.add_request(
            str(i),
            prompt,
            SamplingParams(
                temperature=w.temperature, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            ),
        )
    for _ in range(args.skip):
        engine.step()
    torch.cuda.synchronize()
    batch = len(engine.scheduler.running)
    ctx = sum(s.num_tokens for s in engine.scheduler.running) / max(batch, 1)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / args.steps
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    # the same steps without the profiler's overhead
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t) / args.steps
    print(
        f"batch {batch}, mean context {ctx:.0f}: device busy {device_us / 1e3:.2f} ms/step, "
        f"wall {wall * 1e3:.2f} ms/step under the profiler, {plain * 1e3:.2f} ms/step without"
    )


if __name__ == "__main__":
    main()
