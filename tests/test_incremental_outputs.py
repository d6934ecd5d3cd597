"""Incremental outputs: LLMEngine.step() reports streaming requests every step (CUMULATIVE /
DELTA), FINAL_ONLY once; the incremental detokenizer is right for multi-byte characters and
merged tokens; text that may still become a stop string is held back; request metrics."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import SamplingParams
from nanovllm.engine import output_processor
from nanovllm.engine.detokenizer import IncrementalDetokenizer, stop_prefix_len
from nanovllm.sampling_params import RequestOutputKind
from tests.conftest import cached_llm, prompts_for

MODEL = "qwen3-gqa2-hd64-tied"
CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
MULTI_BYTE = [
    "Héllo 世界 🎉🎉 naïve — “quotes” 日本語のテキスト",
    "👩‍👩‍👧 family, 한국어, Ελληνικά, emoji 🤣🤣",
    "plain ascii, then 💑",
]


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    from nanovllm.loader.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(smollm_path))


@pytest.fixture(scope="module")
def llm():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0)


def run(engine, requests: dict) -> dict[str, list]:
    """Add {request_id: (prompt, params)}, step to the end; every output of each request, in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


# ---------------------------------------------------------------- detokenizer
def feed_one_by_one(tok, ids) -> list[str]:
    det = IncrementalDetokenizer(tok)
    return [det.update([t]) for t in ids]


@pytest.mark.parametrize("text", MULTI_BYTE)
def test_detokenizer_multi_byte_characters(smollm_tokenizer, text):
    """SmolLM2's byte-level BPE splits these characters over several tokens: each piece is
    whole characters, and the pieces add up to the text."""
    tok = smollm_tokenizer
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "no token splits a character: nothing tested"
    pieces = feed_one_by_one(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    # negative control: decoding token by token (no window, no hold-back) breaks the characters
    assert "\ufffd" in "".join(tok.decode([t]) for t in ids)


def test_detokenizer_merged_tokens_and_special_tokens(llm):
    """The zoo's decoder joins words with spaces (the text of two tokens is not the sum of
    their texts); special tokens are skipped as in one decode."""
    tok = llm.get_tokenizer()
    ids = tok.encode("w10 w20 <eos> w30 <|user|> w40 w41")
    assert "".join(feed_one_by_one(tok, ids)) == tok.decode(ids, skip_special_tokens=True) == "w10 w20 w30 w40 w41"
    assert "".join(tok.decode([t], skip_special_tokens=True) for t in ids) != tok.decode(ids, skip_special_tokens=True)


def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ["world"]) == 3
    assert stop_prefix_len("hello w", ["xyz", "wo"]) == 1
    assert stop_prefix_len("hello", ["world"]) == 0
    assert stop_prefix_len("ab", ["abc", "b"]) == 2  # the longest wins
    assert stop_prefix_len("abc", ["abc"]) == 0  # a whole stop string is the stop rule's business


# --------------------------------------------------------- outputs per step
def test_step_reports_every_request_that_got_tokens(llm):
    """Greedy, one token per step after the prefill: a CUMULATIVE and a DELTA request report
    once per token (finished=False until the last), a FINAL_ONLY one once."""
    engine = llm.llm_engine
    prompts = prompts_for(ZOO[MODEL].vocab_size, (9, 23, 5), seed=3)
    base = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
    outs = run(
        engine,
        {
            "cum": (prompts[0], dataclasses.replace(base, output_kind=CUM)),
            "delta": (prompts[1], dataclasses.replace(base, output_kind=DELTA)),
            "final": (prompts[2], dataclasses.replace(base, output_kind=FINAL)),
        },
    )
    assert len(outs["cum"]) == len(outs["delta"]) == 7 and len(outs["final"]) == 1
    for rid, seq in outs.items():
        assert [o.finished for o in seq] == [False] * (len(seq) - 1) + [True], rid
    cum = outs["cum"]
    assert [len(o.outputs[0].token_ids) for o in cum] == list(range(1, 8))
    assert [len(o.outputs[0].logprobs) for o in cum] == list(range(1, 8))
    for a, b in zip(cum, cum[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    delta = outs["delta"]
    assert all(len(o.outputs[0].token_ids) == 1 == len(o.outputs[0].logprobs) for o in delta)
    # each equals the FINAL_ONLY output of the same request run alone
    for rid, prompt in zip(("cum", "delta"), prompts[:2]):
        alone = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0]
        seq = outs[rid]
        if rid == "cum":
            got_text, got_ids, got_lps = (
                seq[-1].outputs[0].text,
                seq[-1].outputs[0].token_ids,
                seq[-1].outputs[0].logprobs,
            )
        else:
            got_text = "".join(o.outputs[0].text for o in seq)
            got_ids = [t for o in seq for t in o.outputs[0].token_ids]
            got_lps = [lp for o in seq for lp in o.outputs[0].logprobs]
        assert (got_text, got_ids) == (alone.text, alone.token_ids), rid
        assert [{t: lp.logprob for t, lp in d.items()} for d in got_lps] == [
            {t: lp.logprob for t, lp in d.items()} for d in alone.logprobs
        ], rid


def test_prompt_logprobs_once_in_delta_mode(llm):
    prompt = prompts_for(ZOO[MODEL].vocab_size, (6,), seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    outs = run(
        llm.llm_engine,
        {
            "d": (prompt, dataclasses.replace(params, output_kind=DELTA)),
            "c": (prompt, dataclasses.replace(params, output_kind=CUM)),
        },
    )
    assert [o.prompt_logprobs is not None for o in outs["d"]] == [True, False, False]
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == 6 for o in outs["c"])


def _stop_case(llm):
    """A greedy output, and a stop string whose start appears one token before it completes."""
    tok = llm.get_tokenizer()
    prompt = prompts_for(ZOO[MODEL].vocab_size, (12,), seed=7)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    words = plain.text.split(" ")
    # stop = " w_a w_b" (tokens 2 and 3): after token 2 the text ends in " w_a", a proper prefix of it
    stop = f" {words[1]} {words[2]}"
    assert stop not in " ".join(words[:2]), "stop string already complete: pick another case"
    return prompt, stop, tok


def test_stop_string_prefix_is_held_back(llm, monkeypatch):
    prompt, stop, _ = _stop_case(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop)
    final = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop

    def streamed(kind):
        outs = run(llm.llm_engine, {"s": (prompt, dataclasses.replace(params, output_kind=kind))})["s"]
        return outs, [o.outputs[0].text for o in outs]

    outs, texts = streamed(CUM)
    assert len(outs) >= 2 and texts[-1] == final.text
    assert all(final.text.startswith(t) for t in texts), texts  # nothing shown is taken back
    _, pieces = streamed(DELTA)
    assert "".join(pieces) == final.text
    # negative control: without the hold-back, the start of the stop string is shown, then cut
    monkeypatch.setattr(output_processor, "stop_prefix_len", lambda text, stops: 0)
    _, texts = streamed(CUM)
    assert not all(final.text.startswith(t) for t in texts), texts


def test_abort_reports_the_rest_in_delta_mode(llm):
    engine = llm.llm_engine
    prompt = prompts_for(ZOO[MODEL].vocab_size, (8,), seed=9)[0]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=DELTA))
    got = []
    while len(got) < 3:
        got += engine.step()
    last = engine.abort_request("a")
    assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# --------------------------------------------------------------------- metrics
def test_request_metrics(llm):
    engine = llm.llm_engine
    prompts = prompts_for(ZOO[MODEL].vocab_size, (30, 4), seed=11)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=CUM)
    outs = run(engine, {"m0": (prompts[0], params), "m1": (prompts[1], params)})
    for seq in outs.values():
        first, last = seq[0].metrics, seq[-1].metrics
        assert first.num_generation_tokens == 1 and last.num_generation_tokens == 5
        assert last.arrival_time <= last.first_scheduled_time <= last.first_token_time
        assert last.first_token_time <= last.last_token_time <= last.finished_time
        assert last.first_token_latency == pytest.approx(last.first_token_time - last.arrival_time)
        assert last.time_in_queue == pytest.approx(last.first_scheduled_time - last.arrival_time)
        assert last.time_in_queue >= 0
        assert first.finished_time is None and first.first_token_time == last.first_token_time
        assert last.num_preemptions == 0
        assert set(last.as_dict()) >= {"arrival_time", "first_token_latency", "time_in_queue", "num_preemptions"}


def test_generate_uses_final_only_and_leaves_params_alone(llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    calls = []
    real = output_processor.IncrementalDetokenizer.update
    monkeypatch.setattr(
        output_processor.IncrementalDetokenizer, "update", lambda self, ids: calls.append(ids) or real(self, ids)
    )
    outs = llm.generate(prompts_for(ZOO[MODEL].vocab_size, (5, 6)), params, use_tqdm=False)
    assert all(o.finished for o in outs) and params.output_kind is CUM
    assert calls == [], "LLM.generate detokenized per step"
    # the same requests streamed do detokenize per step (the probe above works)
    run(llm.llm_engine, {"p": (prompts_for(ZOO[MODEL].vocab_size, (5,))[0], params)})
    assert len(calls) == 3  # every token but the last (the final text is one decode)


def test_output_kind_is_validated():
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
