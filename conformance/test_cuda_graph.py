"""CUDA graphs: catalogue item 14. Decode through captured graphs gives the eager tokens at batch
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
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_equals_eager(engines, dtype, figure):
    g = golden.load(MODEL)
    model = golden.model_dir(g)
    graphs = engines.get(model, device="cuda", dtype=dtype, cuda_graph=True)
    eager = engines.get(model, device="cuda", dtype=dtype, cuda_graph=False)
    require(graphs, GREEDY)
    rng = np.random.default_rng(5)
    checked = 0
    for n in (1, 3, 7, 9, 17, 25, 45):
        prompts = [rng.integers(5, ZOO[MODEL].vocab_size, size=int(rng.integers(1, 70))).tolist()
                   for _ in range(n)]
        want = tokens(generate(eager, prompts, Sampling.greedy(24)))
        got = tokens(generate(graphs, prompts, Sampling.greedy(24)))
        assert_tokens_equal(want, got, f"CUDA graphs vs eager, batch {n}, {dtype}")
        checked += n
    figure("sequences", checked)
