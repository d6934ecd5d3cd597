"""Every per-request field survives preemption: a starved (preempting) run equals an ample one.

The preemption check of test_self_consistency compares the tokens of a starved and an ample run; a request's other fields
were not compared, and a preempted request's prompt logprobs were once appended again on every
recompute (tokens unaffected). Here one workload runs in an ample and in a starved KV cache and
every field the adapter exposes must be equal, request by request, with lengths compared
explicitly (a ``zip`` of two lists of different lengths hides the difference):

* token ids (bitwise, float32: greedy and seeded rows), finish reason, stop reason, text;
* logprobs: one entry per generated token, each with the same tokens, ranks and values (to
  float tolerance: a recompute computes in a prefill what a decode computed; near-ties at the
  k-th place may swap);
* prompt logprobs: exactly one entry per prompt token ([None] first), same tokens and values;
* num_cached_tokens: the prefix-cache hit at *first* admission (the prompts share no block, so
  0 in both runs; a re-admission that finds the request's own blocks does not change it);
* num_preemptions: 0 in the ample run; in the starved one they add up to the engine's count,
  and a request with prompt logprobs is among the preempted ones (else the check is weak).

The workload mixes greedy and seeded sampling rows, stop tokens, EOS, logprobs and prompt
logprobs; what an engine lacks is left out of the requests (and named in the figures).
"""

from __future__ import annotations

import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import (
    EOS,
    GREEDY,
    LOGPROBS,
    PREEMPTION_STATS,
    PROMPT_LOGPROBS,
    SAMPLING,
    SEED,
    STOP_TOKEN_IDS,
)
from conformance.compare import LOGPROB_TOL
from conformance.harness import generate, require

MODEL = "llama-mha-hd64"
CASES = ("len-bs+1", "len-2bs", "len-3bs", "len-5bs+3", "eos", "len-bs-1", "long")


def _workload(cases: dict, caps: frozenset) -> tuple[list[list[int]], list[Sampling], list]:
    lp = 3 if LOGPROBS in caps else None
    plp = 2 if PROMPT_LOGPROBS in caps else None
    left_out = sorted({LOGPROBS, PROMPT_LOGPROBS, SAMPLING, SEED, STOP_TOKEN_IDS, EOS} - caps)
    reqs = [
        ("len-bs+1", Sampling.greedy(72, logprobs=lp, prompt_logprobs=plp)),
        ("len-2bs", Sampling.greedy(64, prompt_logprobs=plp)),
        ("len-3bs", Sampling.greedy(60, logprobs=lp)),
        ("len-5bs+3", Sampling.greedy(56, prompt_logprobs=plp, logprobs=lp)),
        ("eos", Sampling.greedy(64, ignore_eos=EOS not in caps)),
        ("len-bs-1", Sampling.greedy(64)),
        ("long", Sampling.greedy(40, prompt_logprobs=plp)),
    ]
    if STOP_TOKEN_IDS in caps:  # a stop token the greedy run meets mid-way (golden tokens)
        stop = cases["len-3bs"]["greedy"][40]
        reqs[2] = ("len-3bs", reqs[2][1].with_(stop_token_ids=(stop,)))
    if {SAMPLING, SEED} <= caps:
        reqs.append(("len-bs-1", Sampling(temperature=0.8, seed=11, max_tokens=64, ignore_eos=True, logprobs=lp)))
        reqs.append(
            (
                "len-2bs",
                Sampling(temperature=1.1, top_p=0.9, seed=5, max_tokens=48, ignore_eos=True, prompt_logprobs=plp),
            )
        )
    return [cases[c]["prompt"] for c, _ in reqs], [p for _, p in reqs], left_out


def _entry_mismatch(a: dict, b: dict, must_have: int, tol: float) -> str | None:
    """Why two logprob entries of one position differ, or None. Tokens in both: same value (tol),
    same rank unless another token is within 2 * tol (a near-tie); a token in one only: only at a
    near-tie with the other's k-th value. A token ranked below every other token the entries show
    (a prompt or sampled token outside the top k) has neighbours nobody returned, so a near-tie
    with one of them cannot be seen: there its rank may move by one (one swap), no more."""
    if must_have not in a or must_have not in b:
        return f"the token {must_have} is missing ({must_have in a}, {must_have in b})"
    for tok in a.keys() & b.keys():
        if abs(a[tok].logprob - b[tok].logprob) > tol:
            return f"token {tok}: logprob {a[tok].logprob:.6g} vs {b[tok].logprob:.6g}"
        if a[tok].rank != b[tok].rank:
            near = any(abs(a[o].logprob - a[tok].logprob) < 2 * tol for o in a if o != tok)
            shown = max((e[o].rank for e in (a, b) for o in e if o != tok), default=0)
            unseen_swap = min(a[tok].rank, b[tok].rank) > shown and abs(a[tok].rank - b[tok].rank) == 1
            if not (near or unseen_swap):
                return f"token {tok}: rank {a[tok].rank} vs {b[tok].rank}"
    for one, other in ((a, b), (b, a)):
        for tok in one.keys() - other.keys():
            floor = min(lp.logprob for lp in other.values())
            if one[tok].logprob - floor > 2 * tol:
                return f"token {tok} (logprob {one[tok].logprob:.6g}) only in one run"
    return None


def _compare_entries(what: str, want, got, targets: list[int | None], tol: float) -> list[str]:
    if want is None or got is None:
        return [] if want is None and got is None else [f"{what}: present in one run only"]
    if len(want) != len(got) or len(want) != len(targets):
        return [
            f"{what}: {len(got)} entries in the starved run, {len(want)} in the ample one, for {len(targets)} tokens"
        ]
    bad = []
    for t, (a, b, target) in enumerate(zip(want, got, targets)):
        if target is None:
            if a is not None or b is not None:
                bad.append(f"{what}[{t}]: the first prompt token has no logprob ({a}, {b})")
            continue
        why = _entry_mismatch(a, b, target, tol)
        if why:
            bad.append(f"{what}[{t}]: {why}")
    return bad


def test_every_request_field_survives_preemption(engines, figure):
    g = golden.load(MODEL)
    problem = golden.check_model(g)
    if problem:
        pytest.fail(problem)
    cases = {c["id"]: c for c in g["cases"]}
    model = golden.model_dir(g)
    # fresh, not pooled: a pooled engine's prefix cache holds earlier checks' blocks, and a hit there
    # changes num_cached_tokens in the ample run only
    ample = engines.fresh(model)
    require(ample, GREEDY)
    prompts, params, left_out = _workload(cases, ample.capabilities)
    figure("left out (engine lacks)", ", ".join(left_out) or "nothing")
    # 224 slots (14 blocks of 16): the longest request (160 + 40 tokens) fits alone; together they
    # need ~900, so requests are preempted and recomputed again and again. (Equal prompts appear
    # twice, but one of each pair has prompt logprobs or no full block: nothing is shared, so
    # num_cached_tokens is 0 in both runs whatever the admission order.)
    starved = engines.fresh(model, kv_blocks=224 // engines.bs, **engines.optional(max_model_len=224))
    want = generate(ample, prompts, params)
    got = generate(starved, prompts, params)
    tol = 2 * LOGPROB_TOL[g["dtype"]]

    bad = []
    for i, (p, prm, w, r) in enumerate(zip(prompts, params, want, got)):
        name = f"request {i}"
        if r.token_ids != w.token_ids:
            bad.append(f"{name}: tokens differ ({len(r.token_ids)} vs {len(w.token_ids)} tokens)")
            continue
        for field in ("finish_reason", "stop_reason", "text", "num_cached_tokens"):
            if getattr(r, field) != getattr(w, field):
                bad.append(f"{name}: {field} {getattr(r, field)!r} (starved) vs {getattr(w, field)!r} (ample)")
        bad += _compare_entries(f"{name} logprobs", w.logprobs, r.logprobs, list(r.token_ids), tol)
        bad += _compare_entries(
            f"{name} prompt_logprobs", w.prompt_logprobs, r.prompt_logprobs, [None] + list(p[1:]), tol
        )
        if prm.prompt_logprobs is not None and r.prompt_logprobs is None:
            bad.append(f"{name}: asked for prompt logprobs, got none")
        if prm.logprobs is not None and r.logprobs is None:
            bad.append(f"{name}: asked for logprobs, got none")
    assert not bad, f"{len(bad)} field(s) differ between a starved and an ample run: " + "; ".join(bad[:6])
    assert any(r.finish_reason == "stop" for r in want), "no request stopped early: weak check"

    require(starved, PREEMPTION_STATS)
    total = starved.stats().get("preemptions", 0)
    figure("preemptions", total)
    assert total > 0, "the starved run never preempted: the check exercised nothing"
    per_request = [r.num_preemptions for r in got]
    if all(n is not None for n in per_request):
        assert all(w.num_preemptions == 0 for w in want), "the ample run reports preemptions"
        assert sum(per_request) == total, f"per-request preemptions {per_request} do not add up to {total}"
        if PROMPT_LOGPROBS in ample.capabilities:
            assert any(n and prm.prompt_logprobs is not None for n, prm in zip(per_request, params)), (
                "no request with prompt logprobs was preempted: weak check"
            )
