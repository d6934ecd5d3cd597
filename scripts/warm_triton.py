"""Compile the Triton kernels once before a parallel GPU test run.

Every pytest-xdist worker would otherwise JIT-compile the same kernel variants at the same time
(Triton's on-disk cache helps only once a compile has finished). This runs the engine on CUDA
over the zoo models' shapes (head dims, GQA groups, float32 and bfloat16, the tests' block size)
for a prefill, a chunk and decode steps with graphs, filling the cache that the workers then read.

    python scripts/warm_triton.py [--jobs 4]
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time

from conformance.zoo import ZOO


def warm(model: str, dtype: str) -> None:
    from conformance.zoo import zoo_model
    from nanovllm import LLM, SamplingParams

    with LLM(
        zoo_model(model),
        device="cuda",
        dtype=dtype,
        block_size=16,
        max_num_seqs=64,
        kv_cache_memory_gib=0.25,
        max_num_batched_tokens=64,
    ) as llm:
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, top_p=0.9)
        llm.generate([[5] * 90, [7] * 3, [9] * 17], params, use_tqdm=False)
        llm.generate([[5] * 90], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        warm(*args.one)
        return 0
    start = time.perf_counter()
    todo = list(itertools.product(ZOO, ("float32", "bfloat16")))
    running, failed = [], 0
    while todo or running:
        while todo and len(running) < args.jobs:
            model, dtype = todo.pop(0)
            running.append(subprocess.Popen([sys.executable, __file__, "--one", model, dtype]))
        running[0].wait()
        failed += running.pop(0).returncode != 0
    print(
        f"warmed the Triton cache over {len(ZOO) * 2} model/dtype pairs in "
        f"{time.perf_counter() - start:.0f} s ({failed} failed)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
