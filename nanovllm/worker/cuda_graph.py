"""Decode CUDA graphs: capture once per batch size, replay every decode step.

What a graph freezes: kernel pointers, grid sizes and scalar arguments. So:
- Inputs live at fixed device addresses: the graph for batch B is captured over
  ``StepInputs`` views of layout (B tokens, B seqs, max_blocks wide), and staging
  a step of that layout rewrites exactly those bytes (one host->device copy).
- Attention reads lengths from device tensors only (see ``triton_ops``); its
  split-K workspace is reserved before capture.
- A batch of b sequences replays the smallest captured size B >= b; rows b..B-1
  are padding (slot -1: write nothing; seq_len 0: attend to nothing).
- Sizes 1, 2, 4, 8, 16, 24, 32, ... (steps of 8 to 64, then 16) and max_num_seqs
  itself, so every b in 1..max_num_seqs has a graph. Captured largest first into
  one shared memory pool (later, smaller graphs reuse the largest one's blocks);
  the outputs go to one preallocated [max_num_seqs, hidden] buffer.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from nanovllm.core.model_input import ModelInput
from nanovllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Ascending sizes to capture; the last one is max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, max_num_seqs, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        inputs: StepInputs,
        max_num_seqs: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model = model
        self.inputs = inputs
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out = torch.empty(max_num_seqs, hidden_size, dtype=dtype, device=device)
        self.pool: Any = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles Triton kernels for this shape) and capture each size, largest first."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        for batch in reversed(self.sizes):
            step = self.inputs.padding_batch(batch)
            self.model(step.input_ids, step.positions, step.meta)  # eager warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(step.input_ids, step.positions, step.meta)
                self.out[:batch].copy_(hidden)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.0f MiB",
            len(self.graphs),
            self.sizes[-1],
            time.perf_counter() - start,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    def padded_size(self, mi: ModelInput) -> int | None:
        """The captured size to replay ``mi`` with, or None when it must run eagerly."""
        b = len(mi.seq_lens)
        if mi.num_tokens != b or b > self.sizes[-1]:
            return None
        if max(len(t) for t in mi.block_tables) > self.inputs.max_blocks:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, b)]

    def run(self, mi: ModelInput, batch: int, fill_pending=None):
        """Stage ``mi`` padded to ``batch`` rows (``fill_pending(input_ids)`` then completes the
        rows whose token is still on the device), replay; -> (hidden [b, hidden], sample rows)."""
        sample_rows, input_ids = self.inputs.stage_for_graph(mi, batch)
        if fill_pending is not None:
            fill_pending(input_ids)
        self.graphs[batch].replay()
        return self.out[: len(mi.seq_lens)], sample_rows
