"""Which Triton kernels compile after an engine is ready, and how long each takes.

A fresh process's first timed run of the GPU benchmark is ~30 % slower than the next ones;
this names the kernels (and the specialisations of their arguments) that compile during
that run, i.e. the ones start-up does not warm. Run on a GPU host, from the repo root:

    python3 scripts/jit_watch.py [--workload gpu] [--shape qwen3-0.6b] [--kv-cache-dtype auto]

Prints one line per compile: the phase (start-up / warm-up / timed), the time since the
phase began, and the kernel with its specialisation key.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from nanovllm import LLM, SamplingParams
from nanovllm.bench.datasets import build_workload
from nanovllm.bench.peers import _warmup_prompts
from nanovllm.bench.workloads import shape_config_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpu")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()

    phase = {"name": "start-up", "t0": time.perf_counter()}
    compiles: list[tuple[str, float, str]] = []

    def hook(*_a, **kw) -> bool:
        fn = kw.get("fn")
        name = getattr(getattr(fn, "fn", fn), "__name__", "?") if fn is not None else "?"
        key = str(kw.get("key", ""))[:160]
        compiles.append((phase["name"], time.perf_counter() - phase["t0"], f"{name} {key}"))
        return False  # False: compile as usual

    triton.knobs.runtime.jit_cache_hook = hook

    w = build_workload(args.workload, None, None, None, 151936, None)
    extra = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
    llm = LLM(shape_config_dir(args.shape), load_format="dummy", max_model_len=4096, **extra)
    started = time.perf_counter() - phase["t0"]
    phase.update(name="warm-up", t0=time.perf_counter())
    llm.generate(_warmup_prompts(w), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    params = [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    for run in (1, 2):
        phase.update(name=f"timed {run}", t0=time.perf_counter())
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - phase["t0"]
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"timed run {run}: {n / dt:.0f} tok/s ({dt:.2f} s)")
    llm.close()
    print(f"engine start-up {started:.1f} s; compiles: {len(compiles)}")
    for name, t, what in compiles:
        print(f"  [{name} +{t:6.2f}s] {what}")


if __name__ == "__main__":
    main()
