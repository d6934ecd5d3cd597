"""Negative controls of every comparison rule: each must fail on a known-bad input. (nanovllm's
mutant table, which shows the checks catch injected bugs, lives in tests/mutants/.)"""

from __future__ import annotations

import pytest
import torch

import golden
from conformance.compare import DELTA, LOGPROB_TOL, MAX_DIVERGED_FRAC, assert_tokens_equal, compare_greedy
from conformance.harness import golden_step_logprobs


def _case(name="qwen3-gqa4-hd128", cid="len-bs+1"):
    g = golden.load(name)
    return g, next(c for c in g["cases"] if c["id"] == cid)


def test_greedy_rule_rejects_bad_tokens():
    g, c = _case()
    lps = [golden_step_logprobs(c)]
    ok = compare_greedy([c["greedy"]], lps, [c["greedy"]], DELTA["float32"])
    assert ok.ok and ok.num_exact == 1
    # a clear divergence: the reference's 2nd choice where the margin is large
    step = max(range(len(c["top_lps"])), key=lambda t: c["top_lps"][t][0] - c["top_lps"][t][1])
    bad = list(c["greedy"])
    bad[step] = c["top_ids"][step][1]
    assert not compare_greedy([c["greedy"]], lps, [bad], DELTA["float32"]).ok
    # a token outside the reference's top-5 is never a near-tie
    bad[step] = next(t for t in range(5, 1000) if t not in c["top_ids"][step])
    assert not compare_greedy([c["greedy"]], lps, [bad], DELTA["float32"]).ok
    # a sequence that stops early without diverging fails
    assert not compare_greedy([c["greedy"]], lps, [c["greedy"][:-1]], DELTA["float32"]).ok
    # most sequences diverging (even at near-ties) fails the comparison as a whole
    tie = [{1: -0.69310, 2: -0.69315}]
    assert not compare_greedy([[1]] * 3, [tie] * 3, [[2], [2], [1]], DELTA["float32"]).ok


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
