"""Negative controls of every comparison rule: each must fail on a known-bad input. (nanovllm's
mutant table, which shows the checks catch injected bugs, lives in tests/mutants/.)"""

from __future__ import annotations

import pytest
import torch

import golden
from conformance.compare import (
    DELTA,
    FP8_KV,
    LOGPROB_TOL,
    MAX_DIVERGED_FRAC,
    Q4_1,
    assert_tokens_equal,
    compare_greedy,
)
from conformance.harness import assert_logprobs_close, golden_step_logprobs


def _case(name="qwen3-gqa4-hd128", cid="len-bs+1"):
    g = golden.load(name)
    return g, next(c for c in g["cases"] if c["id"] == cid)


def _one_bad_among_exact(c, bad, n_exact=3):
    """The known-bad sequence beside exact ones, with every sequence allowed to diverge: the share
    rule cannot decide the outcome, so a failure is the per-sequence rule's own (a rule test that
    used one sequence alone was decided by the share rule and hid a bug in the rule under test)."""
    lps = [golden_step_logprobs(c)] * (n_exact + 1)
    ref = [c["greedy"]] * (n_exact + 1)
    return compare_greedy(ref, lps, [c["greedy"]] * n_exact + [bad], DELTA["float32"], max_diverged_frac=1.0)


def test_greedy_rule_rejects_bad_tokens():
    g, c = _case()
    lps = [golden_step_logprobs(c)]
    ok = compare_greedy([c["greedy"]], lps, [c["greedy"]], DELTA["float32"])
    assert ok.ok and ok.num_exact == 1
    # a clear divergence: the reference's 2nd choice where the margin is large
    step = max(range(len(c["top_lps"])), key=lambda t: c["top_lps"][t][0] - c["top_lps"][t][1])
    bad = list(c["greedy"])
    bad[step] = c["top_ids"][step][1]
    r = _one_bad_among_exact(c, bad)
    assert not r.ok and not r.too_many_divergences, r.summary()
    assert len(r.failed) == 1 and f"seq 3 step {step}" in r.failed[0] and "margin" in r.failed[0], r.summary()
    # a token outside the reference's top-5 is never a near-tie, whatever share may diverge
    bad[step] = next(t for t in range(5, 1000) if t not in c["top_ids"][step])
    r = _one_bad_among_exact(c, bad)
    assert not r.ok and not r.allowed and "margin unknown" in r.failed[0], r.summary()
    # a sequence that stops early, or runs on, without diverging fails: both directions
    for wrong_length in (c["greedy"][:-1], c["greedy"] + [c["greedy"][-1]]):
        r = _one_bad_among_exact(c, wrong_length)
        assert not r.ok and len(r.failed) == 1 and "lengths differ" in r.failed[0], r.summary()
    # control: the same four sequences, all exact, pass
    assert _one_bad_among_exact(c, list(c["greedy"])).ok


def test_divergence_share_rule_fires_alone():
    """Most sequences diverging, each at a near tie (each allowed on its own), fails the
    comparison as a whole; at half or less it passes. The per-sequence rule fires on none."""
    tie = [{1: -0.69310, 2: -0.69315}]
    r = compare_greedy([[1]] * 3, [tie] * 3, [[2], [2], [1]], DELTA["float32"])
    assert not r.ok and r.too_many_divergences and not r.failed and len(r.allowed) == 2, r.summary()
    r = compare_greedy([[1]] * 4, [tie] * 4, [[2], [2], [1], [1]], DELTA["float32"])
    assert r.ok and len(r.allowed) == 2, r.summary()


def test_logprob_rule_rejects_perturbed_values():
    g, c = _case()
    want = torch.tensor(c["prompt_lps"], dtype=torch.float64)
    torch.testing.assert_close(want + 5e-5, want, atol=LOGPROB_TOL["float32"], rtol=LOGPROB_TOL["float32"])
    with pytest.raises(AssertionError):
        bad = want.clone()
        bad[3] += 1e-2  # tolerance: 1e-4 + 1e-4 * |x| (about 2e-3 here)
        torch.testing.assert_close(bad, want, atol=LOGPROB_TOL["float32"], rtol=LOGPROB_TOL["float32"])


def test_bitwise_rule_rejects_one_token():
    with pytest.raises(AssertionError, match="1/2 sequences differ"):
        assert_tokens_equal([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]], "control")


def test_quantized_delta_still_rejects_wrong_tokens():
    """The delta for quantized arithmetic (measured on SmolLM2-135M Q4_1 with llama.cpp) still
    checks most steps: where the reference's top-1 beats its top-2 by more than delta, a wrong
    token fails, even though every sequence may diverge once at a near-tie."""
    key = "gguf MOSTLY_Q4_1"
    d, frac = DELTA[key], MAX_DIVERGED_FRAC[key]
    g = golden.load(golden.SMOLLM)
    gaps = [c["top_lps"][t][0] - c["top_lps"][t][1] for c in g["cases"] for t in range(len(c["greedy"]))]
    checked = sum(x > d for x in gaps) / len(gaps)
    assert checked > 0.6, f"only {checked:.0%} of the golden steps have a margin above delta {d}"
    c = g["cases"][-1]
    lps = [golden_step_logprobs(c)]
    step = next(t for t in range(len(c["greedy"])) if c["top_lps"][t][0] - c["top_lps"][t][1] > d)
    bad = list(c["greedy"])
    bad[step] = c["top_ids"][step][1]
    assert compare_greedy([c["greedy"]], lps, [c["greedy"]], d, frac).ok
    assert not compare_greedy([c["greedy"]], lps, [bad], d, frac).ok
    # a near-tie divergence (the reference's own second choice within delta) is allowed
    tie = next((t for t in range(len(c["greedy"])) if c["top_lps"][t][0] - c["top_lps"][t][1] < d), None)
    if tie is not None:
        near = list(c["greedy"])
        near[tie] = c["top_ids"][tie][1]
        assert compare_greedy([c["greedy"]], lps, [near], d, frac).ok


class _Quantized:
    """An engine as the harness sees it: only its arithmetic matters to the tolerance tables."""

    def __init__(self, arithmetic):
        self.arithmetic = arithmetic


@pytest.mark.parametrize("arithmetic, at_minus_8", [("float32", 9e-4), (Q4_1, 0.3), (FP8_KV, 0.75)])
def test_prompt_logprob_tolerance_is_the_arithmetic_own(arithmetic, at_minus_8):
    """The tolerance at a logprob of -8, as compare.py's tables define it: float32 1e-4 + 1e-4 * 8;
    the quantized arithmetics an absolute 0.3 (Q4_1) and 0.75 (FP8 KV cache), with no relative
    part. 95 % of it passes, 105 % fails. A check that took the absolute table for the relative
    part would pass -8 + 2.7 for Q4_1, and look right for floats, whose two tables are equal."""
    engine = _Quantized(arithmetic)
    want = torch.tensor([-8.0, -0.5], dtype=torch.float64)
    near = want + torch.tensor([0.95 * at_minus_8, 0.0], dtype=torch.float64)
    assert_logprobs_close(near, want, "float32", engine)
    far = want + torch.tensor([1.05 * at_minus_8, 0.0], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_logprobs_close(far, want, "float32", engine)
