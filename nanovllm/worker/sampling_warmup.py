"""Start-up warm-up of every row count a step can sample (the LM head and the sampler), and of the
runner's out-of-order fill of pending rows.

On CUDA the LM head and the sampler run outside the decode graphs (and in eager steps), on exactly
the rows that sample: any count from 1 to ``max_num_seqs``. Measured on an H100 (BENCHMARKS,
session 22): without this, a fresh process's first run had 18 decode steps whose launch took 5-15
ms of host time instead of ~0.7, at row counts 255, 247, 232, 216, 160, ... 24; a later engine in
the same process had one (5 ms), and the first run was 1.4 % slower than the later one. With it:
one such step (17 ms), and 0.16 %. Why a first launch at a new row count costs that much is not
known. It is not CUDA's lazy module loading: with ``CUDA_MODULE_LOADING=EAGER`` and this warm-up
off, the first run was still 0.83 % behind, with the same ~8 ms tail steps (session 23, H100).
The sampler runs here too (its kernels' variants are compiled by the start-up profile already;
what a new row count meets there is host-to-device copies and small torch operations of that
size); whether that half is needed was not measured separately.

The one slow launch left in that measurement (17 ms) was the first step after a sequence finished
mid-batch: the first whose pending rows are not the leading rows in order, so the runner fills
them with ``scatter_pending`` (a pinned host tensor, ``index_select``, ``index_copy_``), which the
bench's warm-up requests, finishing together, never reach. ``warm_pending_scatter`` runs it once.
With both (session 23, another H100): the first run 6.45 s, the second 6.46 s, and no decode step
of either launched in over 5 ms; the warm-up took 0.18 s of start-up. Both are switched together,
so the scatter's own share was not measured apart.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from nanovllm.layers.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """On unless ``NANOVLLM_ROW_WARMUP=0`` (an environment variable, so that tensor-parallel
    workers see it too; scripts/ab_engine.py rowwarm=0|1 sets it for an A/B)."""
    return os.environ.get("NANOVLLM_ROW_WARMUP", "1") != "0"


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


@torch.inference_mode()
def warm_pending_scatter(scatter: Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], None], device) -> None:
    """The runner's out-of-order fill of pending rows (``ModelRunner.scatter_pending``) once, on
    two rows swapped, so that its first use in a run finds its kernels and pinned memory ready."""
    input_ids = torch.zeros(2, dtype=torch.int64, device=device)
    prev = torch.arange(2, dtype=torch.int64, device=device)
    scatter(input_ids, prev, [1, 0], [0, 1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
