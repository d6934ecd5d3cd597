"""The sampler: greedy, filters, seeded generators, bans, logprobs, non-finite detection."""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p


def _meta(n, **kw):
    base = dict(
        temperatures=[1.0] * n,
        top_ks=[0] * n,
        top_ps=[1.0] * n,
        min_ps=[0.0] * n,
        generators=[None] * n,
        banned_token_ids=[[] for _ in range(n)],
        num_logprobs=[None] * n,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def _sampler(seed=0):
    return Sampler(torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = _sampler()(logits, _meta(5, temperatures=[0.0] * 5))
    assert out.token_ids == logits.argmax(-1).tolist() and out.nonfinite_rows == []


def test_top_k_top_p_keep_exactly_the_expected_sets():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    kept = lambda row: torch.isfinite(row[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))) == [0, 1]
    # top_p 0.7: 0.4 + 0.3 reaches 0.7 -> {0, 1}; 0.71 needs token 2 too
    assert kept(apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))) == [0, 1]
    assert kept(apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.71]))) == [0, 1, 2]
    assert kept(apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))) == [0]
    # min_p: tokens with p >= min_p * 0.4
    assert kept(apply_min_p(logits, torch.tensor([0.45]))) == [0, 1, 2]
    assert kept(apply_min_p(logits, torch.tensor([0.6]))) == [0, 1]


def test_samples_follow_the_distribution_and_stay_in_the_allowed_set():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).clone()
    out = _sampler(1)(logits, _meta(n, top_ks=[3] * n))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float()
    assert counts[3] == 0, "sampled a token top_k removed"
    expected = probs[:3] / probs[:3].sum() * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, f"chi-square {chi2:.1f} (2 dof, p < 0.001)"


@pytest.mark.parametrize(
    "mates",
    [
        [1.0, 1.0, 1.0],  # every mate samples (one with another seed): the row is the 4th sampled row too
        [0.0, 1.0, 0.0],  # greedy mates: it is the 2nd sampled row but the 4th of the batch
    ],
)
def test_seeded_rows_do_not_depend_on_batch_mates(mates):
    """A seeded row draws from its own generator wherever it sits: its batch row, not its index among
    the rows that sample (greedy rows take none). Several seeds, so a wrong generator is seen."""
    for seed in range(8):
        logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(100 + seed))
        alone = _sampler(0)(logits, _meta(1, generators=[torch.Generator().manual_seed(seed)])).token_ids[0]
        batch = torch.cat([torch.randn(3, 100), logits])
        gens = [torch.Generator().manual_seed(99), None, None, torch.Generator().manual_seed(seed)]
        mixed = _sampler(5)(batch, _meta(4, temperatures=[*mates, 1.0], generators=gens)).token_ids[3]
        assert mixed == alone, (seed, mates)


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 100.0
    out = _sampler()(logits, _meta(2, temperatures=[0.0, 1.0], banned_token_ids=[[3], [3]]))
    assert 3 not in out.token_ids


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.randn(2, 30)
    out = _sampler()(logits, _meta(2, temperatures=[0.0, 0.0], num_logprobs=[3, None]))
    lp = torch.log_softmax(logits, -1)
    sampled_lp, rank, top = out.logprobs[0]
    assert rank == 1 and math.isclose(sampled_lp, lp[0].max().item(), abs_tol=1e-6)
    assert [t for t, _ in top] == lp[0].topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_non_finite_rows_are_reported():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    logits[2, 0] = float("inf")
    out = _sampler()(logits, _meta(3, temperatures=[0.0] * 3))
    assert out.nonfinite_rows == [1, 2]


def test_the_cpu_greedy_kernel_takes_the_first_maximum_and_flags_non_finite_rows():
    """The compiled greedy pass (float32 CPU logits, all rows greedy) equals torch.argmax and
    isfinite: ties go to the first index, -inf entries are finite-row-breaking, a row of one
    value gives index 0; rows wide and many enough for the vector tail and for several threads."""
    import pytest

    from nanovllm import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C compiler; see the log)")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49_159, generator=g)
    logits[3, 17] = logits[3, 40_000] = 50.0  # a tie: the first wins
    logits[4] = 0.0  # all equal
    logits[5, 9] = float("nan")
    logits[6, 49_158] = float("inf")
    logits[7, 0] = float("-inf")
    tokens, finite = cpu_kernels.greedy(logits)
    want = logits.argmax(-1)
    finite_rows = torch.isfinite(logits).all(-1)
    assert torch.equal(finite, finite_rows) and finite.tolist().count(False) == 3
    assert torch.equal(tokens[finite_rows], want[finite_rows])
    assert tokens[3] == 17 and tokens[4] == 0
    # control: the last maximum instead of the first is told apart by the tie row
    last = logits.shape[1] - 1 - logits.flip(-1).argmax(-1)
    assert not torch.equal(last[finite_rows], tokens[finite_rows])
    # the sampler takes it for plain greedy rows: same tokens and flags as the PyTorch path
    out = _sampler()(logits, _meta(40, temperatures=[0.0] * 40))
    assert out.nonfinite_rows == [5, 6, 7]
    assert [t for i, t in enumerate(out.token_ids) if i not in (5, 6, 7)] == want[finite_rows].tolist()
