"""Random sampling.

- a seeded request reproduces its tokens, whatever its batch-mates, and another seed changes them;
- the first sampled token follows the reference's filtered distribution (chi-square) for
  temperature, top_k, top_p and min_p, with zero samples outside the allowed set.
"""
from __future__ import annotations

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import MIN_P, SAMPLING, SEED, TOP_K, TOP_P
from conformance.harness import generate, require, tokens
from conformance.stats import chi_square, filtered_distribution

MODEL = "llama-mha-hd64"  # its golden file holds the full next-token distribution of one prompt
N_SAMPLES = 1500
ALPHA = 1e-3


def _setup(engines):
    g = golden.load(MODEL)
    golden.require(g)
    return g, engines.get(golden.model_dir(g))


def _configs(s: dict) -> dict[str, tuple[dict, str | None]]:
    return {
        "temperature": ({"temperature": s["temperature"]}, None),
        "top_k": ({"temperature": 1.0, "top_k": s["top_k"]}, TOP_K),
        "top_p": ({"temperature": 1.0, "top_p": s["top_p"]}, TOP_P),
        "min_p": ({"temperature": 1.0, "min_p": s["min_p"]}, MIN_P),
    }


@pytest.mark.parametrize("which", ["temperature", "top_k", "top_p", "min_p"])
def test_sampling_distribution(engines, which, figure):
    """N single-token samples from one prompt against the filtered reference distribution."""
    g, engine = _setup(engines)
    s = g["sampling"]
    kw, cap = _configs(s)[which]
    require(engine, SAMPLING, *([cap] if cap else []))
    params = Sampling(max_tokens=1, ignore_eos=True, **kw)
    outs = generate(engine, [s["prompt"]] * N_SAMPLES, params)
    samples = [o.token_ids[0] for o in outs]
    probs = filtered_distribution(s["logprobs"], **kw)
    result = chi_square(samples, probs)
    figure("p-value", result.p_value)
    figure("outside allowed set", result.outside)
    allowed = int((probs > 0).sum())
    assert result.outside == 0, f"{which}: {result.outside} samples outside the {allowed} allowed tokens"
    assert result.p_value > ALPHA, f"{which} ({kw}): {result.summary()}"


def test_chi_square_rule_fails_on_wrong_distribution():
    """Negative control: the rule rejects samples of a neighbouring distribution."""
    g = golden.load(MODEL)
    s = g["sampling"]
    gen = torch.Generator().manual_seed(0)
    for which, (kw, _) in _configs(s).items():
        right = filtered_distribution(s["logprobs"], **kw)
        samples = torch.multinomial(right, N_SAMPLES, replacement=True, generator=gen).tolist()
        assert chi_square(samples, right).p_value > ALPHA, f"{which}: a true sample was rejected"
    # top-p keeping one token too few; top-k one too many; min_p as an absolute threshold; temperature 1
    wrong = {
        "top_p": filtered_distribution(s["logprobs"], top_k=3),
        "top_k": filtered_distribution(s["logprobs"], top_k=s["top_k"] + 1),
        "temperature": filtered_distribution(s["logprobs"], temperature=1.0),
    }
    for which, bad in wrong.items():
        kw, _ = _configs(s)[which]
        samples = torch.multinomial(bad, N_SAMPLES, replacement=True, generator=gen).tolist()
        r = chi_square(samples, filtered_distribution(s["logprobs"], **kw))
        assert r.outside > 0 or r.p_value < ALPHA, f"{which}: a wrong distribution passed: {r.summary()}"


def test_seeded_requests_reproducible_and_batch_independent(engines, figure):
    """Same seed, same tokens, alone or among other requests; another seed differs."""
    g, engine = _setup(engines)
    require(engine, SAMPLING, SEED)
    cases = {c["id"]: c["prompt"] for c in g["cases"]}
    needle = cases["len-bs+1"]
    seeded = Sampling(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    other = Sampling(temperature=0.9, max_tokens=24, ignore_eos=True)
    alone = tokens(generate(engine, [needle], seeded))[0]
    again = tokens(generate(engine, [needle], seeded))[0]
    mates = [cases["len-3bs"], cases["len1"], cases["long"], cases["len-bs"]]
    mixed = tokens(generate(engine, [mates[0], needle, mates[1]], [other, seeded, other]))[1]
    crowd = tokens(generate(engine, mates + [needle], [other.with_(seed=i) for i in range(4)] + [seeded]))[-1]
    twin = tokens(generate(engine, [needle, needle], [seeded, seeded]))
    reseeded = tokens(generate(engine, [needle], seeded.with_(seed=99)))[0]
    figure("distinct tokens in the seeded run", len(set(alone)))
    assert again == alone, "the same seed gave different tokens on a second run"
    assert mixed == alone and crowd == alone, "a seeded request's tokens depend on its batch-mates"
    assert twin == [alone, alone], "two identical seeded requests in one batch differ"
    assert reseeded != alone, "a different seed gave the same 24 tokens: is the seed used?"
