"""Start-up warm-up of every row count a step can sample: the LM head and the sampler.

A decode step's body replays a CUDA graph captured (after an eager run) at start-up, but the LM
head and the sampler run outside it, on exactly the rows that sample: any count from 1 to
``max_num_seqs``. cuBLAS picks its kernel by that count, and CUDA loads a kernel's module on the
kernel's first launch in the process, so each count that needs a kernel not launched before pays
~10-15 ms once (measured on an H100: about 17 tail steps of a fresh process's first run, 0.7 ms
of host time for the launch becoming ~15; the same steps of a later engine in that process did
not). The sampler's split count also follows the row count, and Triton builds one variant per
integer specialisation of it. Running every count once here moves those first launches to
start-up (tens of milliseconds once the kernels are loaded).
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
