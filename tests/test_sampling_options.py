"""The sampling options end to end (repetition / frequency / presence penalties, logit_bias,
allowed_token_ids, bad_words): every greedy token the engine generates is the argmax of
transformers' logits for the same tokens, processed by transformers' logits processors in
vLLM's order (tie-aware); each option changes what the model generates (so the check is not
vacuous); async scheduling gives the same tokens as synchronous steps. The checks run on every
device of the host (``device`` fixture: the CPU, and CUDA on a GPU host, where async scheduling,
CUDA graphs and the fused sampler's routing are on the path).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import cached_llm, engine_args, hf_reference, prompts_for
from tests.hf_processors import bad_words_reference, logit_bias_reference

MODEL = "qwen3-gqa2-hd64-tied"  # its greedy output repeats tokens: penalties change it
VOCAB = ZOO[MODEL].vocab_size
PROMPTS = prompts_for(VOCAB, (6, 11), seed=3)
MAX_TOKENS = 12
TIE = 1e-3  # float32 logits of two implementations; a closer call is a tie


@pytest.fixture(scope="module")
def llm(device):
    return cached_llm(zoo_model(MODEL), **engine_args(device, block_size=16, seed=0))


@pytest.fixture(scope="module")
def plain(llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _options(which: str, plain_out: list[int]) -> dict:
    a, b = plain_out[0], plain_out[1]
    return {
        "repetition_penalty": dict(repetition_penalty=1.8),
        "repetition_penalty_below_1": dict(repetition_penalty=0.4),
        "frequency_penalty": dict(frequency_penalty=1.5),
        "presence_penalty": dict(presence_penalty=2.0),
        "negative_penalties": dict(frequency_penalty=-0.5, presence_penalty=-2.0),
        "logit_bias": dict(logit_bias={a: -4.0, (a + 7) % VOCAB: 3.0}),
        "allowed_token_ids": dict(allowed_token_ids=sorted({(a + 13 * i) % VOCAB for i in range(1, 40)} - {a})),
        "bad_words": dict(bad_words=[f"w{a} w{b}", f"w{plain_out[2]}"]),
        "all": dict(
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logit_bias={(a + 7) % VOCAB: 1.0},
            bad_words=[f"w{a} w{b}"],
            allowed_token_ids=sorted({(a + 3 * i) % VOCAB for i in range(200)}),
        ),
    }[which]


def _hf_processed(
    logits: torch.Tensor, prompt: list[int], out: list[int], params: SamplingParams, tokenizer
) -> torch.Tensor:
    """transformers' processors in vLLM's order: allowed, bad words, bias, repetition penalty;
    then frequency and presence penalties (OpenAI's definition: transformers has none)."""
    x = logits.unsqueeze(0).clone()
    if params.allowed_token_ids is not None:
        x = PrefixConstrainedLogitsProcessor(lambda b, i: params.allowed_token_ids, num_beams=1)(
            torch.tensor([prompt + out]), x
        )
    if params.bad_words and out:
        words = [tokenizer.encode(w, add_special_tokens=False) for w in params.bad_words]
        x = bad_words_reference(words, out, x)
    elif params.bad_words:  # no output yet: only single-token words apply
        single = [w for w in params.bad_words if len(tokenizer.encode(w, add_special_tokens=False)) == 1]
        for w in single:
            x[0, tokenizer.encode(w, add_special_tokens=False)[0]] = float("-inf")
    if params.logit_bias:
        x = logit_bias_reference(params.logit_bias, torch.tensor([prompt + out]), x)
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([prompt + out]), x)
    x = x[0]
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


WHICH = [
    "repetition_penalty",
    "repetition_penalty_below_1",
    "frequency_penalty",
    "presence_penalty",
    "negative_penalties",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "all",
]


def check_against_transformers(llm, plain: list[list[int]], which: str) -> None:
    """Generate greedily with option ``which``; every token is the argmax of transformers'
    processed logits (tie-aware), and the option changes some output."""
    hf = hf_reference(zoo_model(MODEL)).model
    tok = llm.get_tokenizer()
    changed = 0
    for prompt, plain_out in zip(PROMPTS, plain):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **_options(which, plain_out))
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == MAX_TOKENS
        changed += out != plain_out
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out])).logits[0].float()
        for t, token in enumerate(out):
            x = _hf_processed(logits[len(prompt) + t - 1], prompt, out[:t], params, tok)
            assert torch.isfinite(x[token]), f"step {t}: generated token {token}, which {which} forbids"
            gap = float(x.max() - x[token])
            assert gap <= TIE, (
                f"{which}, step {t}: generated {token} but transformers' processed argmax is "
                f"{int(x.argmax())} ({gap:.4f} higher)"
            )
    assert changed, f"{which} changed no output: the check is vacuous on these prompts"


@pytest.mark.parametrize("which", WHICH)
def test_greedy_with_option_matches_transformers_processors(llm, plain, which):
    check_against_transformers(llm, plain, which)


def test_async_scheduling_gives_the_same_tokens_with_every_option(plain, device):
    """Penalties and bad words read the tokens so far: with async scheduling the engine waits for
    them (no placeholder), and the outputs equal synchronous steps, sampled rows included. Rows
    that need no history (bias, allowed tokens, plain) run longer, so steps pipeline after the
    others finish."""
    prompts, params = [], []
    for i, which in enumerate(WHICH):
        for j, (prompt, plain_out) in enumerate(zip(PROMPTS, plain)):
            options = _options(which, plain_out)
            history = SamplingParams(**options).has_penalties or "bad_words" in options
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=0.0 if j == 0 else 0.9,
                    seed=i,
                    ignore_eos=True,
                    max_tokens=MAX_TOKENS if history else 3 * MAX_TOKENS,
                    **options,
                )
            )
    prompts += PROMPTS  # plain rows in the same batches
    params += [SamplingParams(temperature=0.8, seed=99, max_tokens=3 * MAX_TOKENS, ignore_eos=True)] * len(PROMPTS)
    results = {}
    for mode in (False, True):
        llm = LLM(
            zoo_model(MODEL),
            **engine_args(device, block_size=4, seed=0, async_scheduling=mode, max_num_batched_tokens=32),
        )
        try:
            results[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.llm_engine.check_invariants()
            pipelined = llm.stats()["pipelined_steps"]
        finally:
            llm.close()
    assert results[True] == results[False]
    assert pipelined > 0, "async scheduling never pipelined: the comparison is vacuous"


def test_tensor_parallel_gives_the_same_tokens_with_every_option(plain, device):
    if device != "cpu":
        pytest.skip("the CPU (gloo) run covers the pickled per-row data; TP on GPUs: tests/test_tp.py")
    """The per-row processing travels to the workers on the ModelInput (pickled): TP=2 (gloo on
    the CPU) gives TP=1's tokens, n > 1 seeded children included."""
    prompts, params = [], []
    for i, which in enumerate(WHICH):
        for prompt, plain_out in zip(PROMPTS, plain):
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True, n=2, **_options(which, plain_out)
                )
            )
    results = []
    for tp in (1, 2):
        llm = LLM(zoo_model(MODEL), device="cpu", block_size=16, seed=0, tensor_parallel_size=tp, max_model_len=256)
        try:
            results.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.close()
    assert results[0] == results[1]
