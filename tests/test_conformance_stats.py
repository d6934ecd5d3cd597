"""The suite's sampling statistics against values computed another way.

The sampling checks only ask "a correct sample passes, a grossly wrong one fails", which a
p-value off by a factor of two (one degree of freedom too many) still satisfies. Here the
chi-square statistic, its degrees of freedom and the survival function are checked against
closed forms (math.erfc and exp; no scipy), so the suite's significance level means what it says.
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance.stats import chi2_sf, chi_square, filtered_distribution


def _sf_closed_form(x: float, df: int) -> float:
    """P(X >= x), X ~ chi-square(df), for df 1-4 (textbook closed forms)."""
    if df == 1:
        return math.erfc(math.sqrt(x / 2))
    if df == 2:
        return math.exp(-x / 2)
    if df == 3:
        return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    if df == 4:
        return math.exp(-x / 2) * (1 + x / 2)
    raise ValueError(df)


@pytest.mark.parametrize("df", [1, 2, 3, 4])
@pytest.mark.parametrize("x", [0.5, 3.0, 7.815, 14.0, 30.0])
def test_chi2_sf_matches_the_closed_forms(x, df):
    assert chi2_sf(x, df) == pytest.approx(_sf_closed_form(x, df), rel=1e-9, abs=1e-15)


def test_chi2_sf_table_value():
    """The 5 % critical value of chi-square with 3 degrees of freedom is 7.8147 (any table)."""
    assert chi2_sf(7.8147, 3) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(7.8147, 4) > 0.09  # one degree too many: a visibly different p (the control)


def test_chi_square_statistic_and_degrees_of_freedom():
    """Counts 130/90/100/80 against a uniform 4-way distribution: stat = (900+100+0+400)/100 = 14,
    3 degrees of freedom (4 bins, one constraint), p = 0.0029."""
    samples = [0] * 130 + [1] * 90 + [2] * 100 + [3] * 80
    r = chi_square(samples, torch.full((4,), 0.25))
    assert (r.n, r.df, r.outside) == (400, 3, 0)
    assert r.stat == pytest.approx(14.0)
    assert r.p_value == pytest.approx(_sf_closed_form(14.0, 3), rel=1e-9)
    assert r.p_value == pytest.approx(0.0029, abs=1e-4)


def test_chi_square_pools_small_bins_into_one():
    """Bins expected below 5 samples are pooled: 100 samples over p = (0.5, 0.46, 0.02, 0.02) keep
    two bins and one pooled bin of 4 expected: 3 bins, 2 degrees of freedom."""
    probs = torch.tensor([0.5, 0.46, 0.02, 0.02], dtype=torch.float64)
    samples = [0] * 50 + [1] * 40 + [2] * 6 + [3] * 4
    r = chi_square(samples, probs)
    want = (50 - 50) ** 2 / 50 + (40 - 46) ** 2 / 46 + (10 - 4) ** 2 / 4
    assert r.df == 2 and r.stat == pytest.approx(want)
    assert r.p_value == pytest.approx(math.exp(-want / 2), rel=1e-9)


def test_chi_square_counts_samples_outside_the_allowed_set():
    r = chi_square([0, 0, 1, 2, 9], torch.tensor([0.5, 0.5, 0.0]))
    assert r.outside == 2  # token 2 (probability 0) and token 9 (past the vocabulary)


def test_filtered_distribution_applies_top_k_before_top_p():
    """vLLM's order: top_k first, then top_p over what top_k kept, renormalised. Probabilities
    0.3, 0.25, 0.2, 0.15, 0.1 with top_k=3, top_p=0.6: after top_k the masses are 0.4, 0.333,
    0.267, and the first two reach 0.6, so two stay. top_p over the whole distribution would
    keep three (0.3 + 0.25 = 0.55 is still under 0.6)."""
    logprobs = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1], dtype=torch.float64))
    p = filtered_distribution(logprobs, top_k=3, top_p=0.6)
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert p[0] == pytest.approx(0.3 / 0.55)
