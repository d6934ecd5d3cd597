"""nanovllm/worker/sampling_warmup.py: start-up runs the LM head on every row count a step can
sample, and the sampler on each where this rank samples, without touching the engine's random
state (the GPU effect itself, fewer first launches in a fresh process's first run, is measured
with scripts/profile_phases.py --runs 2 on a GPU host; BENCHMARKS)."""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.sampler import Sampler
from nanovllm.worker import sampling_warmup
from nanovllm.worker.cuda_graph import graph_batch_sizes


class _Head(torch.nn.Module):
    def __init__(self, vocab: int = 40, hidden: int = 8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden))
        self.rows: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.rows.append(hidden.shape[0])
        return hidden @ self.weight.T


def _assert_covers(rows: list[int], max_rows: int) -> None:
    missing = sorted(set(range(1, max_rows + 1)) - set(rows))
    assert not missing, f"row counts never warmed: {missing[:8]}..."


@pytest.mark.parametrize("sample", [True, False])
def test_every_row_count_goes_through_the_head_and_the_sampler(monkeypatch, sample):
    head = _Head()
    sampled: list[int] = []
    launch = Sampler.launch
    monkeypatch.setattr(
        Sampler,
        "launch",
        lambda self, logits, meta: sampled.append(len(meta.temperatures)) or launch(self, logits, meta),
    )
    sampling_warmup.warm_sampling_rows(head, 37, 8, torch.float32, torch.device("cpu"), sample=sample)
    assert sorted(head.rows) == list(range(1, 38))
    _assert_covers(head.rows, 37)
    assert sampled == (list(range(1, 38)) if sample else [])


def test_warming_only_the_graph_sizes_fails_the_coverage_check():
    # control: the captured sizes (all that the eager run before each capture meets) miss most counts
    with pytest.raises(AssertionError, match="never warmed"):
        _assert_covers(graph_batch_sizes(256), 256)


def test_the_engines_random_state_is_untouched():
    head = _Head()
    before = torch.random.get_rng_state()
    sampling_warmup.warm_sampling_rows(head, 5, 8, torch.float32, torch.device("cpu"), sample=True)
    assert torch.equal(torch.random.get_rng_state(), before)


def _runner(device: str, rank: int = 0):
    """A ModelRunner with only what allocate_kv_cache reads (no model, no layers, eager)."""
    from types import SimpleNamespace

    from nanovllm.worker.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.attn_layers = []
    runner.backend = SimpleNamespace(name="triton")  # no reserve(): nothing to size
    runner.config = SimpleNamespace(
        enforce_eager=True, max_num_seqs=48, max_num_batched_tokens=32, hf_config=SimpleNamespace(hidden_size=8)
    )
    runner.device, runner.dtype, runner.rank, runner.model = torch.device(device), torch.float16, rank, object()
    return runner


@pytest.mark.parametrize("rank", [0, 1])
def test_the_engines_cache_allocation_warms_on_cuda_on_every_rank(monkeypatch, rank):
    calls = []
    monkeypatch.setattr(sampling_warmup, "warm_sampling_rows", lambda *a, **k: calls.append((a, k)))
    scatters = []
    monkeypatch.setattr(sampling_warmup, "warm_pending_scatter", lambda *a: scatters.append(a))
    monkeypatch.delenv("NANOVLLM_ROW_WARMUP", raising=False)
    runner = _runner("cuda", rank)
    runner.allocate_kv_cache(4)
    assert len(calls) == 1
    # every rank fills its own pending rows, so every rank warms the out-of-order fill
    assert len(scatters) == 1 and scatters[0][0] == runner.scatter_pending and scatters[0][1].type == "cuda"
    (model, rows, hidden, dtype, device), kw = calls[0]
    assert rows == 32  # a step samples at most min(max_num_seqs, max_num_batched_tokens) rows
    assert (hidden, dtype, device.type) == (8, torch.float16, "cuda")
    assert kw == {"sample": rank == 0}  # only the rank that samples runs the sampler


def test_no_warm_up_for_the_profiling_cache_on_a_cpu_or_when_switched_off(monkeypatch):
    calls = []
    monkeypatch.setattr(sampling_warmup, "warm_sampling_rows", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(sampling_warmup, "warm_pending_scatter", lambda *a: calls.append(a))
    monkeypatch.delenv("NANOVLLM_ROW_WARMUP", raising=False)
    _runner("cuda").allocate_kv_cache(4, capture_graphs=False)  # the start-up profile's scratch cache
    _runner("cpu").allocate_kv_cache(4)
    monkeypatch.setenv("NANOVLLM_ROW_WARMUP", "0")
    _runner("cuda").allocate_kv_cache(4)
    assert calls == []


def test_the_pending_fill_warm_up_takes_the_out_of_order_path():
    from nanovllm.worker.model_runner import ModelRunner

    seen = []

    def scatter(input_ids, prev, rows, src):
        seen.append((list(rows), list(src)))
        ModelRunner.scatter_pending(input_ids, prev, rows, src)
        seen.append(input_ids.tolist())

    sampling_warmup.warm_pending_scatter(scatter, torch.device("cpu"))
    (rows, src), filled = seen
    # the fast path (a plain copy) is taken when rows == src == 0..k-1; the warm-up must not be that case
    assert not (rows == src == list(range(len(rows))))
    assert filled == [1, 0]  # prev = [0, 1] swapped into place


def test_scatter_pending_moves_each_token_to_its_row():
    from nanovllm.worker.model_runner import ModelRunner

    input_ids = torch.zeros(5, dtype=torch.int64)
    ModelRunner.scatter_pending(input_ids, torch.tensor([10, 11, 12]), [4, 0, 2], [1, 2, 0])
    assert input_ids.tolist() == [12, 0, 10, 0, 11]
