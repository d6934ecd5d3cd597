"""Sampling statistics without scipy: the filtered reference distribution and a chi-square test.

The chi-square survival function is the regularised upper incomplete gamma
function, ``Q(df / 2, x / 2)`` (``torch.special.gammaincc``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


def filtered_distribution(
    logprobs, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """vLLM's meaning: divide by the temperature, keep tokens with p >= min_p * p_max, keep the
    top_k most likely, keep the smallest most-likely set whose probability reaches top_p."""
    logits = torch.as_tensor(logprobs, dtype=torch.float64) / temperature
    p = torch.softmax(logits, dim=-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = torch.argsort(p, descending=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(p))
    if top_k > 0:
        keep &= ranks < top_k
    if top_p < 1.0:
        q = torch.where(keep, p, torch.zeros_like(p))
        q = q / q.sum()
        sorted_q = q[order]
        mass_before = torch.cumsum(sorted_q, 0) - sorted_q
        keep_sorted = mass_before < top_p
        keep &= keep_sorted[ranks]
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    if df <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


@dataclass
class ChiSquare:
    n: int
    stat: float
    df: int
    p_value: float
    outside: int  # samples of tokens whose expected probability is 0

    def summary(self) -> str:
        return (
            f"chi2={self.stat:.1f} df={self.df} p={self.p_value:.2g} over {self.n} samples; "
            f"{self.outside} outside the allowed set"
        )


def chi_square(samples, probs: torch.Tensor, min_expected: float = 5.0) -> ChiSquare:
    """Goodness of fit of ``samples`` (token ids) to ``probs``; bins with fewer than
    ``min_expected`` expected samples are pooled into one."""
    n = len(samples)
    counts = Counter(samples)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    outside = sum(c for t, c in counts.items() if not 0 <= t < len(probs) or probs[t] == 0)
    expected = probs * n
    big = (expected >= min_expected).nonzero().flatten().tolist()
    obs = [counts.get(t, 0) for t in big]
    exp = [float(expected[t]) for t in big]
    rest_exp = n - sum(exp)
    rest_obs = n - sum(obs)
    if rest_exp >= 1e-9 * n:
        obs.append(rest_obs)
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    return ChiSquare(n, stat, df, chi2_sf(stat, df), outside)
