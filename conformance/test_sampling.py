"""Random sampling.

- a seeded request reproduces its tokens, whatever its batch-mates, and another seed changes them;
- the first sampled token follows the reference's filtered distribution (chi-square) for
  temperature, top_k, top_p and min_p, with zero samples outside the allowed set; the filters at
  temperatures other than 1 (temperature first, then the filters), and rows with different
  settings mixed in one batch; seed 0 is a seed.
"""

from __future__ import annotations

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, MIN_P, MIN_TOKENS, SAMPLING, SEED, TOP_K, TOP_P
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


# ------------------------------------------------- filters at other temperatures, mixed batches
# test_sampling_distribution runs every filter at temperature 1, where the order of temperature and filters
# is invisible. vLLM divides by the temperature first, then filters (min_p, top_k, then top_p over
# the top_k survivors). The parameters below are derived from the golden distribution: far from
# any tie at the temperature used, and chosen so the other order (filters on the raw logits)
# keeps a different set of tokens, so the check can tell the two apart.
N_FILTER_SAMPLES = 1000


def _filters_then_temperature(logprobs, temperature: float, **filters) -> torch.Tensor:
    """The wrong order: the kept set decided on the raw distribution, then the temperature."""
    keep = filtered_distribution(logprobs, **filters) > 0
    p = filtered_distribution(logprobs, temperature=temperature)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


def _top_p_between(p: torch.Tensor, lo: int, hi: int) -> list[float]:
    """top_p values (midpoints of the cumulative masses of p's ranks lo..hi, gap >= 0.04)."""
    q = torch.sort(p, descending=True).values
    before = torch.cumsum(q, 0) - q
    return [float(before[j] + before[j + 1]) / 2 for j in range(lo, hi) if before[j + 1] - before[j] >= 0.04]


def _filter_case(lp, which: str, temperature: float) -> dict:
    """Sampling kwargs for ``which`` at ``temperature``: far from ties, order-sensitive."""
    raw = torch.as_tensor(lp, dtype=torch.float64)
    p_t = filtered_distribution(raw, temperature=temperature)
    if which == "top_p":
        options = [{"top_p": tp} for tp in _top_p_between(p_t, 2, 12)]
    elif which == "top_k+top_p":
        k = 8
        top = filtered_distribution(raw, temperature=temperature, top_k=k)
        options = [{"top_k": k, "top_p": tp} for tp in _top_p_between(top, 2, k - 1)]
    else:  # min_p: geometric midpoints between the probability ratios (to the top token) at the temperature
        ratios = torch.sort(p_t / p_t.max(), descending=True).values
        options = [
            {"min_p": float((ratios[j] * ratios[j + 1]).sqrt())}
            for j in range(2, 14)
            if ratios[j] / ratios[j + 1] >= 1.15
        ]
    for kw in options:
        right = filtered_distribution(raw, temperature=temperature, **kw)  # type: ignore[arg-type]
        wrong = _filters_then_temperature(raw, temperature, **kw)
        if ((right > 0) != (wrong > 0)).any():
            return {"temperature": temperature, **kw}
    pytest.fail(f"no {which} setting at temperature {temperature} tells the filter order apart on this golden file")


FILTER_CASES = [("top_p", 1.6), ("min_p", 0.6), ("top_k+top_p", 1.6)]
FILTER_CAPS = {"top_p": [TOP_P], "min_p": [MIN_P], "top_k+top_p": [TOP_K, TOP_P]}


@pytest.mark.parametrize("which,temperature", FILTER_CASES, ids=[f"{w}@{t}" for w, t in FILTER_CASES])
def test_filters_at_other_temperatures(engines, which, temperature, figure):
    """Temperature first, then the filters: the samples follow that distribution, none outside it."""
    g, engine = _setup(engines)
    s = g["sampling"]
    kw = _filter_case(s["logprobs"], which, temperature)
    require(engine, SAMPLING, *FILTER_CAPS[which])
    outs = generate(engine, [s["prompt"]] * N_FILTER_SAMPLES, Sampling(max_tokens=1, ignore_eos=True, **kw))
    probs = filtered_distribution(s["logprobs"], **kw)
    result = chi_square([o.token_ids[0] for o in outs], probs)
    figure("p-value", result.p_value)
    figure("parameters", str(kw))
    assert result.outside == 0, f"{kw}: {result.outside} samples outside the {int((probs > 0).sum())} allowed tokens"
    assert result.p_value > ALPHA, f"{kw}: {result.summary()}"


def test_mixed_rows_in_one_batch(engines, figure):
    """Greedy rows and two different random settings interleaved in one batch: each row uses its
    own temperature and filters (per-row parameters, not the batch's first row's)."""
    g, engine = _setup(engines)
    s = g["sampling"]
    require(engine, GREEDY, SAMPLING, TOP_K, TOP_P)
    cold = {"temperature": 0.6, "top_k": s["top_k"] + 2}
    hot = _filter_case(s["logprobs"], "top_p", 1.6)
    # where the engine takes min_tokens, the greedy rows ban EOS for their one token (the golden
    # prompt's argmax is not an EOS id): an engine that samples plain rows in a fused kernel and
    # sends rows with banned tokens to a general path then mixes greedy and random rows on that
    # path too, so "each row's own parameters" is checked there as well
    greedy = (
        Sampling.greedy(1, ignore_eos=False, min_tokens=1) if MIN_TOKENS in engine.capabilities else Sampling.greedy(1)
    )
    groups = [
        greedy,
        Sampling(max_tokens=1, ignore_eos=True, **cold),
        Sampling(max_tokens=1, ignore_eos=True, **hot),
    ]
    n = N_FILTER_SAMPLES // 2
    outs = generate(engine, [s["prompt"]] * (3 * n), groups * n)
    argmax = int(torch.as_tensor(s["logprobs"]).argmax())
    greedy_tokens = {o.token_ids[0] for o in outs[0::3]}
    assert greedy_tokens == {argmax}, f"greedy rows sampled {sorted(greedy_tokens)}, the argmax is {argmax}"
    for i, kw in ((1, cold), (2, hot)):
        probs = filtered_distribution(s["logprobs"], **kw)
        r = chi_square([o.token_ids[0] for o in outs[i::3]], probs)
        figure(f"p-value {kw}", r.p_value)
        assert r.outside == 0 and r.p_value > ALPHA, f"rows with {kw} in a mixed batch: {r.summary()}"


def test_filter_order_rule_fails_on_wrong_order():
    """Negative control: samples with the filters applied before the temperature are rejected."""
    g = golden.load(MODEL)
    lp = g["sampling"]["logprobs"]
    gen = torch.Generator().manual_seed(1)
    for which, temperature in FILTER_CASES:
        kw = _filter_case(lp, which, temperature)
        t = kw.pop("temperature")
        wrong = _filters_then_temperature(torch.as_tensor(lp, dtype=torch.float64), t, **kw)
        samples = torch.multinomial(wrong, N_FILTER_SAMPLES, replacement=True, generator=gen).tolist()
        r = chi_square(samples, filtered_distribution(lp, temperature=t, **kw))
        assert r.outside > 0 or r.p_value < ALPHA, f"{which}@{temperature}: the wrong order passed: {r.summary()}"


def test_seed_zero_is_a_seed(engines):
    """seed=0 is a seed like any other (not "no seed"): reproducible, and not seed 1's tokens."""
    g, engine = _setup(engines)
    require(engine, SAMPLING, SEED)
    needle = next(c["prompt"] for c in g["cases"] if c["id"] == "len-bs+1")
    zero = Sampling(temperature=1.0, seed=0, max_tokens=24, ignore_eos=True)
    first = tokens(generate(engine, [needle], zero))[0]
    crowd = tokens(generate(engine, [needle, needle, needle], [zero.with_(seed=None), zero, zero.with_(seed=None)]))
    assert crowd[1] == first, "two runs with seed=0 differ (seed 0 treated as no seed?)"
    assert tokens(generate(engine, [needle], zero.with_(seed=1)))[0] != first, "seed 0 and seed 1 gave the same tokens"
