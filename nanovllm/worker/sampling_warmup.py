"""Start-up warm-up of every row count a step can sample: the LM head and the sampler.

A decode step's body replays a CUDA graph captured (after an eager run) at start-up, but the LM head
and the sampler run outside it, on exactly the rows that sample: any count from 1 to
``max_num_seqs``. Measured on an H100 (BENCHMARKS, session 22): without this, a fresh process's
first run had 18 decode steps whose launch took 5-15 ms of host time instead of ~0.7, at row counts
255, 247, 232, 216, 160, ... 24; a later engine in the same process had one (5 ms), and the first
run was 1.4 % slower than the later one. With it: one such step (17 ms), and 0.16 %. Why a first
launch at a new row count costs that much is inferred, not measured: cuBLAS picks its kernel by the
row count, and CUDA loads a kernel's module on its first launch in the process (lazy loading, the
default since CUDA 12.2). The sampler's split count also follows the row count, and Triton builds
one variant per integer specialisation of it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from nanovllm.layers.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)

# on by default on CUDA (model_runner); scripts/ab_engine.py rowwarm=0 turns it off for an A/B
ENABLED = True


@torch.inference_mode()
def warm_sampling_rows(model: Any, max_rows: int, hidden_size: int, dtype, device, sample: bool) -> None:
    """LM head on 1..``max_rows`` rows of zeros; with ``sample`` (the rank that samples) the
    sampler's plain path on each, with a scratch generator (the engine's random state is untouched)."""
    start = time.perf_counter()
    hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    for n in range(1, max_rows + 1):
        logits = model.compute_logits(hidden[:n])
        if sample:
            meta = SamplingMetadata(
                [1.0] * n, [0] * n, [1.0] * n, [0.0] * n, [None] * n, [[] for _ in range(n)], [None] * n,
                row_seeds=[0] * n, seeded=[False] * n,
            )  # fmt: skip
            sampler.launch(logits, meta)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info(
        "ran the LM head%s on 1..%d rows in %.2f s",
        " and the sampler" if sample else "",
        max_rows,
        time.perf_counter() - start,
    )
