"""Parallel sampling (n > 1), vLLM's way: n independent child requests, one RequestOutput.

- the n first tokens of one request follow the model's distribution (chi-square against the
  golden next-token distribution), with and without a seed: the children draw independent
  noise (children sharing one seed would give n equal tokens, which the test rejects);
- with logits processing (repetition penalty, logit bias) the n tokens follow transformers'
  processed distribution;
- a seeded request is reproducible, and child i draws as the request with seed + i;
- the output has n completions, index 0..n-1; abort ends every child; the engine stays clean.

The distribution checks run on every device of the host (``device`` fixture; on a GPU the
children's noise comes from per-row Philox seeds in the fused sampler).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

import golden
from conformance.stats import chi_square, filtered_distribution
from conformance.zoo import ZOO, zoo_model
from nanovllm import SamplingParams
from nanovllm.sampling_params import RequestOutputKind
from tests.conftest import cached_llm, engine_args, hf_reference, prompts_for

MODEL = "llama-mha-hd64"  # its golden file holds the full next-token distribution of one prompt
N = 1200
ALPHA = 1e-3


@pytest.fixture(scope="module")
def llm(device):
    return cached_llm(zoo_model(MODEL), **engine_args(device, block_size=16, seed=0))


@pytest.fixture(scope="module")
def dist():
    g = golden.load(MODEL)
    problem = golden.check_model(g)
    if problem:
        pytest.fail(problem)
    return g["sampling"]


def _first_tokens(llm, prompt, params) -> list[int]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == params.n and [c.index for c in out.outputs] == list(range(params.n))
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    return [c.token_ids[0] for c in out.outputs]


@pytest.mark.parametrize("seed", [1234, None])
def test_n_completions_follow_the_distribution(llm, dist, seed):
    params = SamplingParams(n=N, temperature=1.0, seed=seed, max_tokens=1, ignore_eos=True)
    samples = _first_tokens(llm, dist["prompt"], params)
    result = chi_square(samples, filtered_distribution(dist["logprobs"]))
    assert result.outside == 0 and result.p_value > ALPHA, result.summary()
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.parents


def test_n_completions_follow_the_processed_distribution(llm, dist):
    """Repetition penalty (< 1: the prompt's tokens become likelier) and logit bias on the first
    token: the n samples follow softmax of transformers' processed logits, and neither the
    unprocessed distribution nor the one without the penalty."""
    prompt = dist["prompt"]
    with torch.inference_mode():
        logits = hf_reference(zoo_model(MODEL)).model(torch.tensor([prompt])).logits[0, -1:].float()
    top = logits[0].argsort(descending=True).tolist()
    bias = {top[0]: -1.5, top[3]: 1.0}
    params = SamplingParams(
        n=N, temperature=1.0, seed=7, max_tokens=1, ignore_eos=True, repetition_penalty=0.4, logit_bias=bias
    )
    samples = _first_tokens(llm, prompt, params)
    biased = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])(torch.tensor([prompt]), logits.clone())
    processed = RepetitionPenaltyLogitsProcessor(0.4)(torch.tensor([prompt]), biased.clone())[0]
    right = chi_square(samples, torch.softmax(processed, -1))
    assert right.outside == 0 and right.p_value > ALPHA, right.summary()
    for name, wrong in (("unprocessed", logits[0]), ("without the penalty", biased[0])):
        r = chi_square(samples, torch.softmax(wrong, -1))
        assert r.p_value < ALPHA, f"the samples fit the {name} distribution too: {r.summary()}"


def test_seeded_n_is_reproducible_and_child_i_draws_with_seed_plus_i(llm):
    vocab = ZOO[MODEL].vocab_size
    prompt = prompts_for(vocab, (9,), seed=5)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=40, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert first == again
    alone = [
        llm.generate(
            [prompt], SamplingParams(temperature=1.0, seed=40 + i, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
        for i in range(4)
    ]
    assert first == alone, "child i must draw as the request with seed + i"
    assert len({tuple(t) for t in first}) > 1, "the 4 completions are identical: not independent"
    other = [
        c.token_ids for c in llm.generate([prompt], dataclasses.replace(params, seed=41), use_tqdm=False)[0].outputs
    ]
    assert other[:3] == first[1:], "seed 41's children are seed 40's shifted by one"


FINAL = RequestOutputKind.FINAL_ONLY


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_engine_api_n_outputs_and_abort_ends_every_child(kind):
    """FINAL_ONLY: one output with the n completions; CUMULATIVE: each child's report as the
    parent's output holding that completion (vLLM), the last one finished. Abort ends every child."""
    from nanovllm import LLM

    llm = LLM(zoo_model(MODEL), block_size=16, seed=0)
    engine = llm.llm_engine
    vocab = ZOO[MODEL].vocab_size
    p = prompts_for(vocab, (7, 12), seed=8)
    try:
        a = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=4, ignore_eos=True, output_kind=kind)
        engine.add_request("a", p[0], a)
        engine.add_request(
            "b", p[1], SamplingParams(n=2, temperature=0.8, max_tokens=40, ignore_eos=True, output_kind=kind)
        )
        with pytest.raises(ValueError, match="request_id 'a' is already in use"):
            engine.add_request("a", p[0], SamplingParams())
        with pytest.raises(ValueError, match="request_id '1_b' is already in use"):
            engine.add_request("1_b", p[0], SamplingParams())
        engine.check_invariants()
        done = []
        for _ in range(6):
            done += [o for o in engine.step() if o.request_id == "a"]
        want = [
            c.token_ids
            for c in llm.generate([p[0]], dataclasses.replace(a, output_kind=FINAL), use_tqdm=False)[0].outputs
        ]
        if kind is FINAL:
            assert len(done) == 1 and done[0].finished
            assert [c.index for c in done[0].outputs] == [0, 1, 2]
            assert [c.token_ids for c in done[0].outputs] == want
        else:
            assert all(len(o.outputs) == 1 for o in done) and [o.finished for o in done][-1] is True
            assert not any(o.finished for o in done[:-1])
            last = {}
            for o in done:
                c = o.outputs[0]
                assert len(c.token_ids) >= len(last.get(c.index, [])), "CUMULATIVE reports only grow"
                last[c.index] = c.token_ids
            assert [last[i] for i in range(3)] == want
        aborted = engine.abort_request("b")
        assert aborted.request_id == "b" and aborted.finished
        assert sorted(c.index for c in aborted.outputs) == [0, 1]
        assert [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
        assert not engine.has_unfinished_requests() and not engine.parents and not engine.requests
        engine.check_invariants()
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.close()
