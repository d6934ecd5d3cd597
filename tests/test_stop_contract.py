"""Stop contract: EOS lists, stop_token_ids, stop strings, ignore_eos, min_tokens, max_tokens, max_model_len."""

from __future__ import annotations

import pytest

from conformance.zoo import EOS_ID, ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import cached_llm, engine_args, prompts_for

MODEL = "llama-mha-hd64"


@pytest.fixture(scope="module")
def llm(device):
    return cached_llm(zoo_model(MODEL), **engine_args(device, block_size=16, seed=0))


@pytest.fixture(scope="module")
def free_run(llm, device):
    """A prompt and its first 30 greedy tokens with EOS ignored."""
    prompt = prompts_for(ZOO[MODEL].vocab_size, (12,), seed=21)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert EOS_ID not in out.token_ids[:3]
    return prompt, out.token_ids


def _one(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_max_tokens_gives_length(llm, free_run, device):
    prompt, toks = free_run
    out = _one(llm, prompt, max_tokens=7, ignore_eos=True)
    assert out.token_ids == toks[:7] and out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids(llm, free_run, device):
    prompt, toks = free_run
    target = toks[5]
    first = toks.index(target)
    out = _one(llm, prompt, max_tokens=30, stop_token_ids=[target], ignore_eos=True)
    assert out.token_ids == toks[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_min_tokens_bans_stop_tokens(llm, free_run, device):
    prompt, toks = free_run
    target = toks[0]
    out = _one(llm, prompt, max_tokens=10, min_tokens=4, stop_token_ids=[target], ignore_eos=True)
    assert len(out.token_ids) >= 4
    assert target not in out.token_ids[:4]  # banned while min_tokens is not reached


def test_eos_from_generation_config_stops_unless_ignored(llm, device):
    """Force EOS: the zoo's EOS id 1 is the generation config's; find a prompt where it is sampled."""
    vocab = ZOO[MODEL].vocab_size
    for seed in range(200):
        prompt = prompts_for(vocab, (6,), seed=seed)[0]
        out = _one(llm, prompt, max_tokens=40)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == EOS_ID and out.stop_reason is None
            ignored = _one(llm, prompt, max_tokens=40, ignore_eos=True)
            assert ignored.token_ids[: len(out.token_ids)] == out.token_ids
            assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"
            return
    pytest.fail("no prompt sampled EOS within 200 tries: cannot check EOS handling")


def test_stop_strings_trimmed_or_included(llm, free_run, device):
    prompt, toks = free_run
    tok = llm.get_tokenizer()
    full = _one(llm, prompt, max_tokens=30, ignore_eos=True).text
    word = tok.decode([toks[6]])
    assert word in full
    out = _one(llm, prompt, max_tokens=30, stop=[word], ignore_eos=True)
    cut = full.index(word)
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == full[:cut]
    inc = _one(llm, prompt, max_tokens=30, stop=[word], include_stop_str_in_output=True, ignore_eos=True)
    assert inc.text == full[: cut + len(word)]


def test_max_model_len_gives_length(device):
    path = zoo_model(MODEL)
    small = LLM(path, **engine_args(device, block_size=16, seed=0, max_model_len=20))
    prompt = prompts_for(ZOO[MODEL].vocab_size, (15,), seed=1)[0]
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=20"):
        small.generate([prompts_for(ZOO[MODEL].vocab_size, (20,))[0]], use_tqdm=False)
