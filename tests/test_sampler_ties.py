"""The sampler at the edges of its rules: a min_p threshold met exactly, and ranks among tied logprobs.

Both rules are written with one comparison (``p < min_p * p_max`` drops a token; the rank is one
plus the number of strictly more likely tokens), so only inputs that sit exactly on the boundary
(tied probabilities) tell ``<`` from ``<=`` or ``>`` from ``>=``. Expected sets and ranks come from
the definitions, not from running the code.
"""

from __future__ import annotations

import math

import torch

from nanovllm.layers.sampler import Sampler, apply_min_p
from tests.test_sampler import _meta  # every field at its neutral value, some overridden


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_min_p_keeps_the_tokens_exactly_at_the_threshold():
    """SamplingParams: min_p drops tokens *less* likely than min_p times the most likely one, so a
    token exactly at the threshold stays. min_p = 1.0 (allowed: [0, 1]) keeps exactly the tokens
    tied for the maximum; tied logits give bitwise equal probabilities, so the threshold is met
    exactly."""
    logits = torch.tensor([[2.0, 0.5, 2.0, -1.0, 2.0]])
    assert _kept(apply_min_p(logits, torch.tensor([1.0]))) == [0, 2, 4]
    # the same through the sampler: min_p = 1.0 samples only the tied maxima, and all of them
    n = 600
    out = Sampler(torch.Generator().manual_seed(0))(logits.expand(n, 5).clone(), _meta(n, min_ps=[1.0] * n))
    assert set(out.token_ids) == {0, 2, 4}, sorted(set(out.token_ids))
    assert out.nonfinite_rows == []


def test_min_p_one_without_ties_is_greedy():
    """min_p = 1.0 with a single most likely token leaves that token only (never an empty set)."""
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    filtered = apply_min_p(logits, torch.ones(8))
    assert torch.equal(torch.isfinite(filtered).sum(-1), torch.ones(8, dtype=torch.long))
    out = Sampler(torch.Generator().manual_seed(1))(logits, _meta(8, min_ps=[1.0] * 8))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_rank_counts_only_strictly_more_likely_tokens():
    """``Logprob.rank``: 1 = the most likely token. Under ties, the greedy token (the first maximum)
    is still rank 1, and a sampled token's rank is one plus the number of tokens strictly more likely
    (tokens tied with it do not push it down): the rule the prompt logprobs use too."""
    vocab = 16
    # row 0: every logit equal -> greedy token 0, rank 1, logprob -log(vocab)
    # row 1: two tied maxima (3 and 7), greedy takes 3: rank 1
    # row 2: 0 and 1 banned (tied top pair), greedy takes the first of the tied pair 2, 5: rank 3
    logits = torch.zeros(3, vocab)
    logits[1, [3, 7]] = 4.0
    logits[2, [0, 1]] = 6.0
    logits[2, [2, 5]] = 3.0
    meta = _meta(3, temperatures=[0.0] * 3, num_logprobs=[2, 2, 2], banned_token_ids=[[], [], [0, 1]])
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.token_ids == [0, 3, 2]
    ranks = [entry[1] for entry in out.logprobs]
    assert ranks == [1, 1, 3], ranks
    assert math.isclose(out.logprobs[0][0], -math.log(vocab), abs_tol=1e-6)
