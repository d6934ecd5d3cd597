"""Against the reference (golden files from transformers, float32).

- prompt logprobs vs reference at prompt lengths {1, bs-1, bs, bs+1, 2bs, 3bs, 5bs+3, ...};
- greedy vs reference, tie-aware, 64 tokens (zoo and SmolLM2-135M);
- float32 greedy exact on the peaked zoo models;
- prefill/decode consistency: the engine re-scores prompt + output in one prefill, and its argmax
  must be the token it generated wherever the margin exceeds delta.
Engines in quantized arithmetic are judged with the delta and tolerance measured for it
(conformance/compare.py).
"""

from __future__ import annotations

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, PROMPT_LOGPROBS
from conformance.compare import compare_greedy
from conformance.harness import (
    assert_logprobs_close,
    delta,
    generate,
    golden_step_logprobs,
    max_diverged_frac,
    require,
    tokens,
)

NAMES = golden.NAMES
ZOO_NAMES = sorted(golden.ZOO_FILES)
_runs: dict = {}


def golden_engine(engines, name: str, **knobs):
    g = golden.load(name)
    golden.require(g)
    return g, engines.get(golden.model_dir(g), **knobs)


def greedy_run(engines, name: str):
    """The engine's 64 greedy tokens for every golden case of ``name`` (one batch, cached)."""
    key = (engines.name, name)
    if key not in _runs:
        g, engine = golden_engine(engines, name)
        require(engine, GREEDY)
        cases = g["cases"]
        got = tokens(generate(engine, [c["prompt"] for c in cases], Sampling.greedy(g["max_tokens"])))
        _runs[key] = (g, engine, got)
    return _runs[key]


def greedy_report(g, got, engine):
    cases = g["cases"]
    return compare_greedy(
        [c["greedy"] for c in cases],
        [golden_step_logprobs(c) for c in cases],
        got,
        delta(g["dtype"], engine),
        max_diverged_frac(g["dtype"], engine),
    )


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_reference(engines, name, figure):
    """The logprob of every prompt token given the ones before it, to fp32 tolerance."""
    g, engine = golden_engine(engines, name)
    require(engine, PROMPT_LOGPROBS)
    cases = g["cases"]
    outs = generate(engine, [c["prompt"] for c in cases], Sampling.greedy(1, prompt_logprobs=1))
    worst = 0.0
    for case, out in zip(cases, outs):
        prompt = case["prompt"]
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt), (
            f"case {case['id']}: {0 if plp is None else len(plp)} prompt logprob entries for {len(prompt)} tokens"
        )
        assert plp[0] is None, f"case {case['id']}: the first prompt token has no logprob (got {plp[0]})"
        for p in range(1, len(prompt)):
            assert prompt[p] in plp[p], f"case {case['id']}: position {p} lacks the prompt token {prompt[p]}"
        got = torch.tensor([plp[p][prompt[p]].logprob for p in range(1, len(prompt))], dtype=torch.float64)
        want = torch.tensor(case["prompt_lps"], dtype=torch.float64)
        if len(want):
            worst = max(worst, float((got - want).abs().max()))
            assert_logprobs_close(
                got, want, g["dtype"], engine, msg=lambda m, c=case: f"case {c['id']} (len {len(c['prompt'])}): {m}"
            )
    figure("max logprob diff", worst)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_reference(engines, name, figure):
    """64 greedy tokens, tie-aware against the reference's top-5."""
    g, engine, got = greedy_run(engines, name)
    report = greedy_report(g, got, engine)
    figure("exact", f"{report.num_exact}/{report.num_seqs}")
    figure("divergences", len(report.allowed) + len(report.failed))
    assert report.ok, report.summary()


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_fp32_greedy_exact_on_zoo(engines, name, figure):
    """The zoo's logits are peaked; in float32 every sequence must be exact."""
    g, engine, got = greedy_run(engines, name)
    report = greedy_report(g, got, engine)
    figure("exact", f"{report.num_exact}/{report.num_seqs}")
    assert report.num_exact == report.num_seqs, report.summary()


@pytest.mark.parametrize("name", ["qwen3-gqa4-hd128", "llama-1kv-hd128", golden.SMOLLM])
def test_prefill_decode_consistency(engines, name, figure):
    """Decode produced token t; a prefill over prompt + output must rank it first
    (or within delta of the first)."""
    g, engine = golden_engine(engines, name)
    require(engine, GREEDY, PROMPT_LOGPROBS)
    cases = [c for c in g["cases"] if c["id"] in ("len-bs+1", "len-5bs+3", "prefix-2bs-b", "long")]
    got = tokens(generate(engine, [c["prompt"] for c in cases], Sampling.greedy(32)))
    rescored = generate(
        engine, [c["prompt"] + out for c, out in zip(cases, got)], Sampling.greedy(1, prompt_logprobs=2)
    )
    bad, worst, compared = [], 0.0, 0
    for case, out, res in zip(cases, got, rescored):
        n = len(case["prompt"])
        for t, tok in enumerate(out):
            entry = res.prompt_logprobs[n + t]
            top_tok = min(entry, key=lambda k: entry[k].rank)
            compared += 1
            if top_tok != tok:
                margin = entry[top_tok].logprob - entry[tok].logprob
                worst = max(worst, margin)
                if margin >= delta(g["dtype"], engine):
                    bad.append(
                        f"case {case['id']} step {t}: decode chose {tok}, prefill ranks {top_tok} first by {margin:.3g}"
                    )
    figure("tokens compared", compared)
    figure("max margin at a mismatch", worst)
    assert not bad, f"{len(bad)} decode/prefill disagreements: " + "; ".join(bad[:5])
