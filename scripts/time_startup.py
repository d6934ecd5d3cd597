"""Time the engine's start-up as the GPU bench builds it (the seeded Qwen3-0.6B shape, dummy
weights, ``max_model_len=4096``), with the engine's INFO log lines and their times, so that each
start-up stage (load, memory profile, graph capture, the row warm-up) shows its share.

    PYTHONPATH=. python3 scripts/time_startup.py [--kv-cache-dtype fp8]

Prints ``built in S s`` last. ``NANOVLLM_ROW_WARMUP=0`` in the environment turns the row warm-up
off for an A/B (nanovllm/worker/sampling_warmup.py).
"""

from __future__ import annotations

import argparse
import logging
import time

FORMAT = "%(relative)7.2f s  %(name)s: %(message)s"  # ``relative``: stamped by _Relative


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    start = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Relative(start))
    from nanovllm import LLM
    from nanovllm.bench.workloads import shape_config_dir

    config = shape_config_dir("qwen3-0.6b")
    with LLM(config, load_format="dummy", max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype):
        print(f"built in {time.perf_counter() - start:.2f} s (imports included)", flush=True)


class _Relative(logging.Filter):
    """Stamps each record with the seconds since the script started."""

    def __init__(self, start: float):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        record.relative = time.perf_counter() - self.start
        return True


if __name__ == "__main__":
    main()
