"""Item 25: the suite catches injected bugs. Negative controls of every comparison rule (each must
fail on a known-bad input), one in-process mutant as a smoke test of the machinery, and (slow) the
whole mutant table: every mutant caught by at least one check."""
from __future__ import annotations

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.compare import DELTA, LOGPROB_TOL, assert_tokens_equal, compare_greedy
from conformance.harness import generate, golden_step_logprobs, tokens


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


@pytest.mark.nanovllm_only
def test_mutant_machinery_smoke(engines):
    """A mutant switched on in this process breaks the engine; switched off, the engine is right again."""
    if engines.name != "nanovllm":
        pytest.skip("mutants are bugs injected into nanovllm")
    from conformance.mutants import activate

    g, c = _case()
    engine = engines.fresh(golden.model_dir(g), prefix_cache=False)  # no corrupted K/V is reused later
    with activate("slot_mapping_off_by_one"):
        bad = tokens(generate(engine, [c["prompt"]], Sampling.greedy(16)))[0]
    good = tokens(generate(engine, [c["prompt"]], Sampling.greedy(16)))[0]
    assert good == c["greedy"][:16]
    assert bad != good, "the slot-mapping mutant did not change the output"


@pytest.mark.slow
@pytest.mark.nanovllm_only
def test_every_mutant_is_caught():
    """The full mutant table (python -m conformance.mutants): no mutant survives."""
    from conformance.mutants import main

    assert main([]) == 0
