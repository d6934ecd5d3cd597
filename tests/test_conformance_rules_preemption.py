"""The starved-vs-ample logprob entry rule (conformance/test_preemption_fields.py): near-ties."""

from __future__ import annotations

from types import SimpleNamespace as LP

from conformance.test_preemption_fields import _entry_mismatch

TOL = 1e-4


def _entry(**ranks_and_values):
    return {int(k[1:]): LP(rank=r, logprob=v) for k, (r, v) in ranks_and_values.items()}


def test_equal_entries_pass():
    a = _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(420, -9.0))
    assert _entry_mismatch(a, dict(a), 9, TOL) is None


def test_unseen_neighbour_swap_of_a_low_ranked_token_passes():
    """rank 420 vs 419 of the target outside the top k (seen on CUDA: chunking moves a logit by ~1e-6)."""
    a = _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(420, -9.0))
    b = _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(419, -9.0))
    assert _entry_mismatch(a, b, 9, TOL) is None


def test_negative_controls_fail():
    a = _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(420, -9.0))
    # the low-ranked token moved by two: more than one swap
    assert "rank" in _entry_mismatch(a, _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(418, -9.0)), 9, TOL)
    # a top-k token's rank changed with no visible near-tie
    assert "rank" in _entry_mismatch(a, _entry(t1=(2, -0.1), t2=(1, -2.0), t9=(420, -9.0)), 9, TOL)
    # a value moved beyond the tolerance
    assert "logprob" in _entry_mismatch(a, _entry(t1=(1, -0.1), t2=(2, -2.0), t9=(420, -9.01)), 9, TOL)
