"""CUDA graphs. Decode through captured graphs gives the eager tokens at batch
sizes around the capture buckets {1, 3, 7, 9, 17, 25, 45} (padding rows must not disturb real ones)."""

from __future__ import annotations

import numpy as np
import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY
from conformance.compare import assert_tokens_equal
from conformance.harness import generate, require, tokens
from conformance.zoo import ZOO

MODEL = "qwen3-gqa4-hd128"


@pytest.mark.gpu
@pytest.mark.pinned_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_equals_eager(engines, dtype, figure):
    g = golden.load(MODEL)
    model = golden.model_dir(g)
    # fresh engines, largest batch first: the first sequences hold the lowest blocks (slot 0
    # included) while later, padded batches run, so a padding row that writes K/V hits a live one
    graphs = engines.fresh(model, device="cuda", dtype=dtype, cuda_graph=True)
    eager = engines.fresh(model, device="cuda", dtype=dtype, cuda_graph=False)
    require(graphs, GREEDY)
    rng = np.random.default_rng(5)
    checked = 0
    for n in (45, 25, 17, 9, 7, 3, 1):
        prompts = [rng.integers(5, ZOO[MODEL].vocab_size, size=int(rng.integers(1, 70))).tolist() for _ in range(n)]
        # staggered lengths: sequences finish at different steps, so the batch shrinks through
        # several graph sizes (each padded) while the others are still decoding
        params = [Sampling.greedy(31 - (i * 5) % 24) for i in range(n)]  # the first one lasts longest
        want = tokens(generate(eager, prompts, params))
        got = tokens(generate(graphs, prompts, params))
        assert_tokens_equal(want, got, f"CUDA graphs vs eager, batch {n}, {dtype}")
        checked += n
    figure("sequences", checked)
