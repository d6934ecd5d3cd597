"""Exact boundaries of the API contracts (prompt logprobs, stopping, logprobs) at their edges.

* A stop token can end a request at exactly output index ``min_tokens`` (the first index where it
  is allowed), and at index ``min_tokens - 1`` it is banned: the sampler takes the next best token
  (the golden run's second-ranked one).
* A stop string counts only in the text of more than ``min_tokens`` tokens (vLLM's rule): one
  completed by the ``min_tokens``-th token is not a stop, one completed by the next token is.
* A stop string that spans a token boundary (the end of one generated word and the start of the
  next) stops at the token that completes it, and the text is cut before (or after) it.
* Prompt logprobs of a prompt longer than any internal chunk of rows (1300 tokens) equal those
  computed in 128-token steps, one entry per prompt token.
* ``logprobs=0`` / ``prompt_logprobs=0``: exactly the sampled / prompt token, with its rank.

Expectations come from the golden greedy run (tokens and top-5 per step) or from the engine's
own unconstrained run of the same prompt (texts), never from the run under test.
"""

from __future__ import annotations

import numpy as np
import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, LOGPROBS, MIN_TOKENS, PROMPT_LOGPROBS, STOP_STRINGS, STOP_TOKEN_IDS, TEXT
from conformance.compare import LOGPROB_TOL
from conformance.harness import delta, generate, require
from conformance.zoo import ZOO

MODEL = "llama-mha-hd64"
LONG_PROMPT = 1300


@pytest.fixture(scope="module")
def setup(engines):
    g = golden.load(MODEL)
    problem = golden.check_model(g)
    if problem:
        pytest.fail(problem)
    return g, {c["id"]: c for c in g["cases"]}, engines.get(golden.model_dir(g))


def _first_new(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("case_id", ["len-bs", "len-3bs"])
def test_stop_token_at_exactly_min_tokens(setup, case_id):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_TOKEN_IDS, MIN_TOKENS)
    greedy = cases[case_id]["greedy"]
    m = _first_new(greedy, 3)
    target = greedy[m]
    out = generate(engine, [cases[case_id]["prompt"]], Sampling.greedy(m + 12, min_tokens=m, stop_token_ids=(target,)))[
        0
    ]
    assert out.token_ids == greedy[: m + 1], (
        f"min_tokens={m}, stop token {target} = greedy token {m}: must stop right there, got {out.token_ids}"
    )
    assert out.finish_reason == "stop" and out.stop_reason == target, (out.finish_reason, out.stop_reason)


@pytest.mark.parametrize("case_id", ["len-bs", "len-3bs"])
def test_stop_token_banned_until_min_tokens(setup, case_id):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_TOKEN_IDS, MIN_TOKENS)
    c = cases[case_id]
    greedy = c["greedy"]
    m = _first_new(greedy, 3) + 1
    target = greedy[m - 1]  # the greedy token at index m - 1: banned there
    out = generate(engine, [c["prompt"]], Sampling.greedy(m + 12, min_tokens=m, stop_token_ids=(target,)))[0]
    assert out.token_ids[: m - 1] == greedy[: m - 1], "tokens before the banned position changed"
    ids, lps = c["top_ids"][m - 1], c["top_lps"][m - 1]
    assert ids[0] == target
    # the next best token; a near-tie with the third may swap them
    allowed = {ids[j] for j in range(1, len(ids)) if lps[1] - lps[j] < delta(g["dtype"])}
    assert out.token_ids[m - 1] in allowed, (
        f"min_tokens={m}: at index {m - 1} the stop token {target} is banned, so the next best {sorted(allowed)} "
        f"comes; got {out.token_ids[m - 1]}"
    )
    assert target not in out.token_ids[:m], "the stop token came before min_tokens"
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == target and len(out.token_ids) > m


def _texts(engine, prompt: list[int], n: int) -> list[str]:
    """text of the first k greedy tokens, k = 0..n (the detokenized text grows by prefixes)."""
    texts: list = [""] + [generate(engine, [prompt], Sampling.greedy(k))[0].text for k in range(1, n + 1)]
    for k in range(n):
        assert texts[k + 1].startswith(texts[k]), f"text of {k + 1} tokens does not extend the text of {k}"
    return texts


def test_stop_string_spanning_a_token_boundary(setup):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_STRINGS, TEXT)
    c = cases["len-2bs"]
    texts = _texts(engine, c["prompt"], 16)
    full = texts[-1]
    # two characters of token i's text + two of token i+1's: completed only by token i + 1
    picked = None
    for i in range(4, 14):
        cut = len(texts[i + 1])
        stop = full[cut - 2 : cut + 2]
        if len(texts[i + 1]) - len(texts[i]) >= 2 and len(texts[i + 2]) - cut >= 2 and full.find(stop) == cut - 2:
            picked = (i, cut, stop)
            break
    assert picked, f"no token boundary of {full!r} gives a stop string seen only there"
    i, cut, stop = picked
    assert stop not in texts[i + 1]
    out = generate(engine, [c["prompt"]], Sampling.greedy(16, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop, (out.finish_reason, out.stop_reason)
    assert out.token_ids == c["greedy"][: i + 2], (
        f"stop string {stop!r} spans tokens {i} and {i + 1}: {len(out.token_ids)} tokens, expected {i + 2}"
    )
    assert out.text == full[: cut - 2], f"text {out.text!r}, expected {full[: cut - 2]!r}"
    inc = generate(engine, [c["prompt"]], Sampling.greedy(16, stop=(stop,), include_stop_str_in_output=True))[0]
    assert inc.text == full[: cut + 2], f"text {inc.text!r}, expected {full[: cut + 2]!r}"


def test_stop_string_counts_only_past_min_tokens(setup):
    g, cases, engine = setup
    require(engine, GREEDY, STOP_STRINGS, TEXT, MIN_TOKENS)
    c = cases["len-bs"]
    n = 20
    texts = _texts(engine, c["prompt"], n)
    full = texts[-1]

    def word(k: int) -> str:  # the text the k-th token (index k - 1) adds, without the separator
        return texts[k][len(texts[k - 1]) :].strip()

    # the m-th token's word occurs nowhere else; the next token's word first where it is added
    m = next(
        k
        for k in range(3, n - 1)
        if word(k) and full.count(word(k)) == 1 and full.find(word(k + 1)) == full.index(word(k + 1), len(texts[k]))
    )
    word_m, word_next = word(m), word(m + 1)
    early = generate(engine, [c["prompt"]], Sampling.greedy(n, min_tokens=m, stop=(word_m,)))[0]
    assert early.token_ids == c["greedy"][:n] and early.finish_reason == "length", (
        f"stop string {word_m!r} is completed by the {m}-th token = min_tokens: not a stop (got "
        f"{len(early.token_ids)} tokens, {early.finish_reason})"
    )
    late = generate(engine, [c["prompt"]], Sampling.greedy(n, min_tokens=m, stop=(word_next,)))[0]
    assert late.token_ids == c["greedy"][: m + 1] and late.finish_reason == "stop", (
        f"stop string {word_next!r} is completed by token index {m} > min_tokens: a stop"
    )
    assert late.text == full[: full.index(word_next)]


def test_prompt_logprobs_of_a_long_prompt(engines, figure):
    """1300 prompt tokens (past internal chunks of 512 or 1024 rows): the logprobs equal those of
    the same prompt computed in 128-token steps (no internal chunking), one entry per token."""
    g = golden.load(MODEL)
    model = golden.model_dir(g)
    prompt = np.random.default_rng(5).integers(5, ZOO[MODEL].vocab_size, size=LONG_PROMPT).tolist()
    params = Sampling.greedy(1, prompt_logprobs=2)
    whole = engines.get(model, **engines.optional(max_model_len=2048))
    require(whole, PROMPT_LOGPROBS)
    stepped = engines.get(model, max_batched_tokens=128, **engines.optional(max_model_len=2048))
    a, b = generate(whole, [prompt], params)[0], generate(stepped, [prompt], params)[0]
    for name, r in (("whole", a), ("in 128-token steps", b)):
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(prompt), (
            f"{name}: {0 if r.prompt_logprobs is None else len(r.prompt_logprobs)} entries for {len(prompt)} tokens"
        )
        assert r.prompt_logprobs[0] is None
    tol = 2 * LOGPROB_TOL[g["dtype"]]
    bad = [
        p
        for p in range(1, len(prompt))
        if prompt[p] not in a.prompt_logprobs[p]
        or prompt[p] not in b.prompt_logprobs[p]
        or abs(a.prompt_logprobs[p][prompt[p]].logprob - b.prompt_logprobs[p][prompt[p]].logprob) > tol
    ]
    worst = (
        max(
            abs(a.prompt_logprobs[p][prompt[p]].logprob - b.prompt_logprobs[p][prompt[p]].logprob)
            for p in range(1, len(prompt))
            if p not in bad
        )
        if len(bad) < len(prompt) - 1
        else float("nan")
    )
    figure("max logprob diff", worst)
    assert not bad, f"{len(bad)} positions differ, first {bad[:5]}"


def test_zero_logprobs_give_the_token_alone(setup):
    g, cases, engine = setup
    require(engine, GREEDY, LOGPROBS, PROMPT_LOGPROBS)
    c = cases["len-bs+1"]
    out = generate(engine, [c["prompt"]], Sampling.greedy(8, logprobs=0, prompt_logprobs=0))[0]
    assert out.token_ids == c["greedy"][:8]
    assert out.logprobs is not None and len(out.logprobs) == 8, "logprobs=0: one entry per generated token"
    for t, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry) == [tok], f"step {t}: logprobs=0 gives the sampled token alone, got {list(entry)}"
        assert entry[tok].rank in (1, None), f"step {t}: the greedy token has rank {entry[tok].rank}"
        assert abs(entry[tok].logprob - c["top_lps"][t][0]) < 2 * LOGPROB_TOL[g["dtype"]]
    prompt = c["prompt"]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        assert list(out.prompt_logprobs[p]) == [prompt[p]], f"position {p}: {list(out.prompt_logprobs[p])}"
