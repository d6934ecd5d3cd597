"""Request options at their non-default values, and output fields nobody else reads.

* ``chat(add_generation_prompt=False)``: the prompt is the conversation alone, with no assistant
  header; ``True`` adds it. Expected ids are spelled from the zoo's chat template and word-level
  vocabulary ("<|user|> " + content + " ", then "<|assistant|> "), not from the tokenizer's own
  templating; the prompt text keeps the special tokens.
* ``skip_special_tokens=False``: the output text keeps special tokens (here the EOS token the
  greedy run produces with ``ignore_eos``), both in plain text and in the text a stop string is
  searched in and cut from; a stop string can be a special token's text only then.
* ``decoded_token`` of every logprob entry (top-k, sampled, prompt) is the tokenizer's decoding of
  that entry's token.
"""

from __future__ import annotations

import pytest

import golden
from conformance.zoo import BOS_ID, EOS_ID, SPECIAL_TOKENS, zoo_model
from nanovllm import SamplingParams
from tests.conftest import cached_llm

MODEL = "llama-mha-hd64"
EOS_TEXT = SPECIAL_TOKENS[EOS_ID]


@pytest.fixture(scope="module")
def llm():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0)


@pytest.fixture(scope="module")
def eos_case():
    """A golden prompt whose greedy run produces EOS, and the index where it does."""
    case = next(c for c in golden.load(MODEL)["cases"] if c["id"] == "eos")
    at = case["greedy"].index(EOS_ID)
    assert at + 6 < len(case["greedy"]), "the EOS case must go on for a few tokens after EOS"
    return case, at


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


@pytest.mark.parametrize("add", [False, True])
def test_chat_generation_prompt_option(llm, add):
    conv = [
        {"role": "user", "content": "w10 w11"},
        {"role": "assistant", "content": "w12"},
        {"role": "user", "content": "w13"},
    ]
    user, assistant = SPECIAL_TOKENS.index("<|user|>"), SPECIAL_TOKENS.index("<|assistant|>")
    want = [user, 10, 11, assistant, 12, user, 13] + ([assistant] if add else [])
    out = llm.chat(conv, _greedy(max_tokens=3, ignore_eos=True), use_tqdm=False, add_generation_prompt=add)[0]
    assert out.prompt_token_ids == want, f"add_generation_prompt={add}: prompt {out.prompt_token_ids}, expected {want}"
    assert out.prompt == llm.get_tokenizer().decode(want, skip_special_tokens=False)
    assert "<|user|>" in out.prompt
    plain = llm.generate([want], _greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_skip_special_tokens_false_keeps_them_in_the_text(llm, eos_case):
    case, at = eos_case
    tok = llm.get_tokenizer()
    n = at + 6
    texts = {}
    for skip in (True, False):
        out = llm.generate(
            [case["prompt"]], _greedy(max_tokens=n, ignore_eos=True, skip_special_tokens=skip), use_tqdm=False
        )[0].outputs[0]
        assert out.token_ids == case["greedy"][:n]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip), f"skip_special_tokens={skip}"
        texts[skip] = out.text
    assert EOS_TEXT in texts[False] and EOS_TEXT not in texts[True], texts


def test_stop_string_in_text_with_special_tokens(llm, eos_case):
    """With skip_special_tokens=False the stop-string text keeps EOS: a word after it cuts the text
    after "<eos>", and "<eos>" itself is a stop string; with True it never is."""
    case, at = eos_case
    tok = llm.get_tokenizer()
    n = at + 6
    full = tok.decode(case["greedy"][:n], skip_special_tokens=False)
    word = tok.decode([case["greedy"][at + 3]])
    assert full.count(word) == 1 and full.index(word) > full.index(EOS_TEXT), "pick a word seen once, after EOS"
    out = llm.generate(
        [case["prompt"]], _greedy(max_tokens=n, ignore_eos=True, skip_special_tokens=False, stop=[word]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == case["greedy"][: at + 4]
    assert out.text == full[: full.index(word)], f"text {out.text!r}, expected {full[: full.index(word)]!r}"
    at_eos = llm.generate(
        [case["prompt"]],
        _greedy(max_tokens=n, ignore_eos=True, skip_special_tokens=False, stop=[EOS_TEXT]),
        use_tqdm=False,
    )[0].outputs[0]
    assert at_eos.finish_reason == "stop" and at_eos.stop_reason == EOS_TEXT
    assert at_eos.token_ids == case["greedy"][: at + 1], "the stop string '<eos>' is completed by the EOS token"
    skipped = llm.generate([case["prompt"]], _greedy(max_tokens=n, ignore_eos=True, stop=[EOS_TEXT]), use_tqdm=False)[
        0
    ].outputs[0]
    assert skipped.finish_reason == "length" and len(skipped.token_ids) == n, (
        "with skip_special_tokens=True the text never holds '<eos>'"
    )


def test_decoded_token_of_every_logprob_entry(llm, eos_case):
    case, _ = eos_case
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate([[BOS_ID] + case["prompt"]], params, use_tqdm=False)[0]
    entries = [d for d in out.outputs[0].logprobs] + [d for d in out.prompt_logprobs if d is not None]
    checked = 0
    for d in entries:
        for token, lp in d.items():
            assert lp.decoded_token == tok.decode([token]), (
                f"token {token}: decoded_token {lp.decoded_token!r}, the tokenizer says {tok.decode([token])!r}"
            )
            checked += 1
    assert checked > 2 * len(entries), "entries must hold more than the sampled/prompt token"
