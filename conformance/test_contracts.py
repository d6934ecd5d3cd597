"""API contracts: stopping and logprobs.

- stop strings, stop_token_ids, EOS, ignore_eos, min_tokens, max_tokens -> exact tokens,
  finish_reason, stop_reason and text;
- logprobs=k gives k or k+1 entries per token, rank 1 = the argmax, values equal the reference's
  log_softmax (greedy), and for a sampled request the raw distribution's (re-scored by a prefill).
"""

from __future__ import annotations

import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import (
    EOS,
    GREEDY,
    LOGPROBS,
    MIN_TOKENS,
    PROMPT_LOGPROBS,
    SAMPLING,
    SEED,
    STOP_STRINGS,
    STOP_TOKEN_IDS,
    TEXT,
)
from conformance.compare import LOGPROB_TOL
from conformance.harness import delta, generate, require
from conformance.zoo import EOS_ID

MODEL = "llama-mha-hd64"


@pytest.fixture(scope="module")
def setup(engines):
    g = golden.load(MODEL)
    golden.require(g)
    return g, {c["id"]: c for c in g["cases"]}, engines.get(golden.model_dir(g))


def _one(engine, prompt, **kw):
    return generate(engine, [prompt], Sampling(temperature=0.0, **kw))[0]


def test_max_tokens_finish_length(setup):
    g, cases, engine = setup
    require(engine, GREEDY)
    c = cases["len-bs"]
    out = _one(engine, c["prompt"], max_tokens=7, ignore_eos=True)
    assert out.token_ids == c["greedy"][:7]
    assert out.finish_reason == "length" and out.stop_reason is None, (out.finish_reason, out.stop_reason)


def test_stop_token_ids(setup):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_TOKEN_IDS)
    toks = cases["len-bs"]["greedy"]
    target = toks[5]
    first = toks.index(target)
    out = _one(engine, cases["len-bs"]["prompt"], max_tokens=30, stop_token_ids=(target,), ignore_eos=True)
    assert out.token_ids == toks[: first + 1], "generation must stop at (and include) the stop token"
    assert out.finish_reason == "stop" and out.stop_reason == target, (out.finish_reason, out.stop_reason)


def test_min_tokens_defers_stop(setup):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_TOKEN_IDS, MIN_TOKENS)
    c = cases["len-bs"]
    target = c["greedy"][0]
    out = _one(engine, c["prompt"], max_tokens=12, min_tokens=4, stop_token_ids=(target,), ignore_eos=True)
    assert len(out.token_ids) >= 4, f"stopped after {len(out.token_ids)} < min_tokens=4 tokens"
    assert target not in out.token_ids[:4], "a stop token was generated before min_tokens"
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == target


def test_eos_stops_unless_ignored(setup):
    g, cases, engine = setup
    require(engine, GREEDY, EOS)
    if "eos" not in cases:
        pytest.fail("the golden file has no 'eos' case: regenerate it (python -m golden.make)")
    c = cases["eos"]
    at = c["greedy"].index(EOS_ID)
    out = _one(engine, c["prompt"], max_tokens=40)
    assert out.token_ids == c["greedy"][: at + 1], "generation must stop at (and include) EOS"
    assert out.finish_reason == "stop" and out.stop_reason is None, (out.finish_reason, out.stop_reason)
    ignored = _one(engine, c["prompt"], max_tokens=40, ignore_eos=True)
    assert ignored.token_ids == c["greedy"][:40] and ignored.finish_reason == "length"


def test_stop_strings_trimmed_or_included(setup):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_STRINGS, TEXT)
    c = cases["len-bs"]
    full = _one(engine, c["prompt"], max_tokens=30, ignore_eos=True)
    if not full.text:
        pytest.fail(f"engine {engine.name} returned no text for a model with a tokenizer")
    word = full.text.split()[6]
    cut = full.text.index(word)
    # generation stops at the first token whose text completes the stop string
    words = full.text.split()
    n_tokens = next(i + 1 for i in range(len(words)) if word in " ".join(words[: i + 1]))
    out = _one(engine, c["prompt"], max_tokens=30, stop=(word,), ignore_eos=True)
    assert out.finish_reason == "stop" and out.stop_reason == word, (out.finish_reason, out.stop_reason)
    assert out.text == full.text[:cut], f"text {out.text!r}, expected {full.text[:cut]!r}"
    assert out.token_ids == full.token_ids[:n_tokens]
    inc = _one(engine, c["prompt"], max_tokens=30, stop=(word,), include_stop_str_in_output=True, ignore_eos=True)
    assert inc.text == full.text[: cut + len(word)], f"text {inc.text!r}"


def _check_entries(entries, generated, k, what):
    assert entries is not None and len(entries) == len(generated), f"{what}: one logprob entry per token"
    for t, (tok, entry) in enumerate(zip(generated, entries)):
        assert len(entry) in (k, k + 1), f"{what} step {t}: {len(entry)} entries for logprobs={k}"
        assert tok in entry, f"{what} step {t}: the sampled token is missing"
        extra = len(entry) == k + 1  # the sampled token is outside the top-k and comes on top
        ranks = sorted(lp.rank for t2, lp in entry.items() if not (extra and t2 == tok))
        assert ranks == list(range(1, k + 1)), f"{what} step {t}: top-{k} ranks {ranks}"
        if extra:
            _check_outside_top_k(entry, tok, k, f"{what} step {t}")


def _check_outside_top_k(entry, tok, k, where, tol: float = 1e-6):
    """The sampled token's entry beside the top-k: rank > k where the engine gives ranks; where it
    cannot (OpenAI's legacy ``logprobs`` carries values only: rank None), a value no greater than
    the k-th one, the same statement in values."""
    lp = entry[tok]
    if lp.rank is not None:
        assert lp.rank > k, f"{where}: extra entry has rank {lp.rank} <= {k}"
        return
    kth = min(e.logprob for t2, e in entry.items() if t2 != tok)
    assert lp.logprob <= kth + tol, (
        f"{where}: the token outside the top-{k} has logprob {lp.logprob} > the {k}-th's {kth}"
    )


def _same_rank(served, prefill, k) -> bool:
    """Equal ranks; a served rank None (a format without ranks: the token is outside the top-k,
    how far is not said) matches a prefill rank beyond k."""
    if served is None:
        return prefill is not None and prefill > k
    return served == prefill


def test_logprobs_greedy_match_reference(setup, figure):
    """Top-k ids and values against the golden top-5; rank 1 is the greedy token."""
    g, cases, engine = setup
    require(engine, GREEDY, LOGPROBS)
    k = 5
    picked = [cases[i] for i in ("len1", "len-bs+1", "len-3bs")]
    outs = generate(engine, [c["prompt"] for c in picked], Sampling.greedy(24, logprobs=k))
    worst = 0.0
    for c, out in zip(picked, outs):
        _check_entries(out.logprobs, out.token_ids, k, c["id"])
        assert out.token_ids == c["greedy"][:24]
        for t, entry in enumerate(out.logprobs):
            top = min(entry, key=lambda tok: entry[tok].rank)
            assert top == out.token_ids[t], f"{c['id']} step {t}: rank 1 is {top}, greedy chose {out.token_ids[t]}"
            want = dict(zip(c["top_ids"][t], c["top_lps"][t]))
            for tok, lp in entry.items():
                if tok in want:
                    worst = max(worst, abs(lp.logprob - want[tok]))
            # the engine's top-k are the reference's, except where a near-tie reorders the k-th
            ref_vals = sorted(want.values(), reverse=True)
            for tok, lp in entry.items():
                if lp.rank <= k and tok not in want:
                    assert ref_vals[k - 1] - lp.logprob < delta(g["dtype"]) + LOGPROB_TOL[g["dtype"]], (
                        f"{c['id']} step {t}: token {tok} (rank {lp.rank}) is not in the reference's top-{k}"
                    )
    figure("max logprob diff", worst)
    assert worst < LOGPROB_TOL[g["dtype"]] * 2, f"logprobs differ from the reference by up to {worst:.3g}"


def test_logprobs_sampled_are_raw_distribution(setup, figure):
    """With temperature 0.7 the logprobs are still the raw model's (vLLM's meaning):
    re-scoring prompt + output by a prefill gives the same values."""
    g, cases, engine = setup
    require(engine, SAMPLING, SEED, LOGPROBS, PROMPT_LOGPROBS)
    k = 3
    c = cases["len-2bs"]
    out = generate(
        engine, [c["prompt"]], Sampling(temperature=0.7, seed=3, max_tokens=16, logprobs=k, ignore_eos=True)
    )[0]
    _check_entries(out.logprobs, out.token_ids, k, "sampled")
    rescored = generate(engine, [c["prompt"] + out.token_ids], Sampling.greedy(1, prompt_logprobs=k))[0]
    n = len(c["prompt"])
    worst = 0.0
    for t, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = rescored.prompt_logprobs[n + t]
        worst = max(worst, abs(entry[tok].logprob - ref[tok].logprob))
        assert _same_rank(entry[tok].rank, ref[tok].rank, k), (
            f"step {t}: rank {entry[tok].rank} vs prefill {ref[tok].rank}"
        )
    figure("max logprob diff", worst)
    assert worst < 2 * LOGPROB_TOL[g["dtype"]], f"sampled logprobs differ from the prefill's by {worst:.3g}"
