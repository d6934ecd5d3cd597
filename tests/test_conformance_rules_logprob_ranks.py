"""The logprob-entry rules of conformance/test_contracts.py where an engine's format carries no
ranks (OpenAI's legacy ``logprobs``: the adapter gives a sampled token outside the top-k rank
None): the rule then holds the value to the top-k's, and each rule fails on a known-bad entry."""

from __future__ import annotations

from types import SimpleNamespace as LP

import pytest

from conformance.test_contracts import _check_entries, _same_rank


def _entry(**ranks_and_values):
    return {int(k[1:]): LP(rank=r, logprob=v) for k, (r, v) in ranks_and_values.items()}


TOP3 = dict(t1=(1, -0.5), t2=(2, -1.0), t3=(3, -2.0))


@pytest.mark.parametrize("rank", [7, None])
def test_a_sampled_token_outside_the_top_k_passes_with_or_without_its_rank(rank):
    _check_entries([_entry(**TOP3, t9=(rank, -3.5))], [9], 3, "ok")


def test_negative_controls_fail():
    # a ranked extra entry inside the top-k
    with pytest.raises(AssertionError, match="rank 2 <= 3"):
        _check_entries([_entry(**TOP3, t9=(2, -3.5))], [9], 3, "bad")
    # an unranked extra entry more likely than the third: it cannot be outside the top-3
    with pytest.raises(AssertionError, match="outside the top-3 has logprob"):
        _check_entries([_entry(**TOP3, t9=(None, -1.5))], [9], 3, "bad")


def test_same_rank():
    assert _same_rank(5, 5, 3) and _same_rank(None, 4, 3) and _same_rank(None, 400, 3)
    # negative controls: a different rank; no rank where the prefill puts the token in the top-k
    assert not _same_rank(5, 4, 3)
    assert not _same_rank(None, 3, 3)
    assert not _same_rank(None, None, 3)
