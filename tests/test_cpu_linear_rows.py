"""A row's product does not depend on the rows beside it on the CPU (float32, bitwise), for every K.

oneDNN's packed linear sums one row alone in another order than the same row among others where
K > 1,024 (torch 2.13.0+cpu on the AVX-512 development machine: 512-element K blocks each summed
from zero, against blocks chained in pairs): a batch-1 decode step of SmolLM2-135M (its down
projection has K = 1,536) gave other last bits than the same sequence in a batch (57 of 64 greedy
logprobs differed; the tokens happened to agree). ``cpu_linear.linear`` multiplies such a row as a
pair. The zoo's models all have K <= 512, below the threshold, so the engine-level check here builds
one whose down projection crosses it.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN (mkldnn) is not available in this torch")

KS = (64, 576, 1024, 1088, 1536, 2048, 3072, 4096)  # both sides of every K blocking threshold seen
BATCHES = (1, 2, 3, 7, 33, 200)


def _packed(n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return w, torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT)


def _rows_alone_and_in_batches(product, k: int, seed: int) -> list[int]:
    """The batch sizes at which row 0's result differs from its result alone."""
    x = torch.randn(max(BATCHES), k, generator=torch.Generator().manual_seed(seed + 1))
    alone = product(x[:1])[0]
    return [m for m in BATCHES if not torch.equal(product(x[:m])[0], alone)]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", (48, 576))
@pytest.mark.parametrize("bias", (False, True))
def test_a_rows_product_is_the_same_alone_and_in_any_batch(k, n, bias):
    w, packed = _packed(n, k, seed=k + n)
    b = torch.randn(n) if bias else None
    differ = _rows_alone_and_in_batches(lambda x: cpu_linear.linear(x, w, b, packed), k, seed=k)
    assert not differ, f"K={k}: row 0 alone differs from row 0 in batches of {differ}"


def test_the_rule_catches_onednn_called_directly():
    """Negative control: oneDNN's op itself, one row alone, at K = 1,536 (SmolLM2's down projection)."""
    w, packed = _packed(576, 1536, seed=1)
    raw = lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")  # noqa: E731
    differ = _rows_alone_and_in_batches(raw, 1536, seed=1)
    if not differ:
        pytest.skip("this machine's oneDNN sums one row like a batch at K=1536: there is no bad input to show")
    assert differ == list(BATCHES[1:])  # every batch differs from the row alone, none from each other


@pytest.fixture(scope="module")
def wide_mlp_model(tmp_path_factory):
    """A llama whose down projection has K = 1,536 (> 1,024), random seeded weights."""
    pytest.importorskip("transformers", reason="the zoo builder writes the config with transformers")
    from conformance.zoo import ZooSpec, build

    dest = tmp_path_factory.mktemp("wide-mlp")
    build(ZooSpec("llama", 128, 2, 4, 2, 32, 1536, 512, False, seed=11), dest)
    return str(dest)


def _needle_logprobs(llm, batch_sizes) -> dict[int, list[float]]:
    from nanovllm import SamplingParams
    from tests.conftest import prompts_for

    needle = prompts_for(512, (21,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    out = {}
    for n in batch_sizes:
        batch = prompts_for(512, [5 + 7 * i for i in range(n - 1)], seed=n)
        pos = n // 2
        batch.insert(pos, needle)
        got = llm.generate(batch, params, use_tqdm=False)[pos].outputs[0]
        out[n] = [d[t] for t, d in zip(got.token_ids, got.logprobs)]
    return out


def _differing(by_batch: dict) -> list[int]:
    return [n for n, lp in by_batch.items() if lp != by_batch[1]]


def test_engine_logprobs_are_bitwise_the_same_alone_and_in_a_batch(wide_mlp_model, monkeypatch):
    """Float32 on the CPU: the needle's greedy logprobs, alone and among 1, 2 and 6 others, equal
    bitwise (decode steps at batch 1 go through K = 1,536). Control: with a lone row passed to
    oneDNN as it is, the same comparison fails."""
    from nanovllm import LLM
    from tests.conftest import engine_args

    llm = LLM(wide_mlp_model, **engine_args("cpu", block_size=16, seed=0))
    try:
        assert not _differing(_needle_logprobs(llm, (1, 2, 3, 7)))
        monkeypatch.setattr(cpu_linear, "_PAIR_SINGLE_ROWS", {})
        monkeypatch.setattr(cpu_linear, "_single_row_differs", lambda *args: False)
        assert _differing(_needle_logprobs(llm, (1, 2))) == [2], "the control shows nothing"
    finally:
        llm.close()
