"""`nanovllm bench`'s flags (torch-free, so the CLI's --help loads no torch)."""
from __future__ import annotations

import argparse

from nanovllm.bench.workloads import SHAPES

PEERS = ("hf", "hf-cb", "vllm")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("auto", "cpu", "gpu"), default="auto",
                   help="BENCH.md workload (auto: gpu when CUDA is available, else cpu) (default: auto)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b",
                   help="random-weight model shape for the gpu workload (default: qwen3-0.6b)")
    p.add_argument("--peer", action="append", choices=PEERS, default=[],
                   help="also run this peer on the same workload (repeatable) (default: none)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of nanovllm; the median is reported (default: 1)")
    p.add_argument("--warm", action="store_true", help="also time nanovllm on the same prompts again "
                                                      "(prefix cache warm)")
    p.add_argument("--vllm-python", default=None, help="python of a virtual env with vllm(-cpu) installed "
                                                       "(default: $NANOVLLM_VLLM_PYTHON or ./.venv-vllm)")
    p.add_argument("--json-out", default=None, help="write the measurements as JSON here (default: none)")
    p.add_argument("--profile-steps", action="store_true", help="print where each engine step's time goes")
