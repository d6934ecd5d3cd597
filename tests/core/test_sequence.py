"""Sequence: counts, views of prompt and output, placeholders, stop ids, history needs."""

from __future__ import annotations

import pytest

from nanovllm.core.model_output import ModelOutput, ReadyOutput, SamplerOutput
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.utils import cdiv
from nanovllm.sampling_params import SamplingParams

from .conftest import make_seq


def test_counts_and_views():
    seq = make_seq([5, 6, 7])
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    seq.append_token(8)
    seq.append_token(9)
    assert (seq.num_tokens, seq.num_output_tokens) == (5, 2)
    assert seq.prompt_token_ids == [5, 6, 7] and seq.output_token_ids == [8, 9]
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_computed_tokens, seq.block_table, seq.block_hashes) == (0, [], [])
    assert (seq.num_cached_tokens, seq.num_preemptions, seq.finish_reason, seq.stop_reason) == (-1, 0, None, None)
    assert (seq.output_text, seq.cumulative_logprob, seq.pending_row, seq.num_placeholders) == ("", 0.0, None, 0)
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished


def test_prompt_is_copied():
    prompt = [1, 2]
    seq = make_seq(prompt)
    seq.append_token(3)
    assert prompt == [1, 2]


def test_placeholder():
    seq = make_seq([1, 2])
    seq.add_placeholder(4)
    assert (seq.num_tokens, seq.num_output_tokens, seq.pending_row, seq.token_ids) == (3, 1, 4, [1, 2])
    with pytest.raises(AssertionError, match="already waits for a token"):
        seq.add_placeholder(5)
    seq.drop_placeholder()
    assert (seq.num_tokens, seq.pending_row, seq.num_placeholders) == (2, None, 0)
    seq.add_placeholder(0)
    assert seq.pending_row == 0


def test_stop_token_ids():
    assert make_seq([1], eos=[9], stop_token_ids=[3]).stop_token_ids == {3, 9}
    assert make_seq([1], eos=[9], stop_token_ids=[3], ignore_eos=True).stop_token_ids == {3}
    assert make_seq([1], eos=[9, 10]).stop_token_ids == {9, 10}


def test_logprob_records():
    plain = make_seq([1, 2])
    assert plain.output_logprobs is None and plain.prompt_logprobs is None
    assert plain.num_prompt_logprobs_recorded == 0
    seq = make_seq([1, 2], logprobs=0, prompt_logprobs=0)
    assert seq.output_logprobs == [] and seq.prompt_logprobs == [None]
    assert seq.num_prompt_logprobs_recorded == 1


def test_logits_processing_and_token_history():
    assert not make_seq([1]).logits_processing
    assert not make_seq([1]).needs_token_history
    assert make_seq([1], logit_bias={1: 1.0}).logits_processing
    assert not make_seq([1], logit_bias={1: 1.0}).needs_token_history
    assert make_seq([1], repetition_penalty=1.2).needs_token_history
    assert not make_seq([1], bad_words=[[4]]).needs_token_history  # single-token bad word
    assert make_seq([1], bad_words=[[4], [5, 6]]).needs_token_history  # multi-token bad word
    bad = [[5, 6]]
    seq = make_seq([1], bad_words=bad)
    assert seq.bad_words_token_ids == [[5, 6]] and seq.bad_words_token_ids is not bad
    assert make_seq([1]).bad_words_token_ids == []


def test_repr_and_metrics():
    seq = make_seq([1, 2], request_id="req-7")
    assert repr(seq) == "Sequence('req-7', tokens=2, computed=0, blocks=[], waiting)"
    assert seq.metrics.arrival_time > 0
    assert seq.parent is None and seq.arrival == 0 and seq.prompt is None


def test_constructor_arguments_are_kept():
    parent = object()
    seq = Sequence(41, "req", [1], SamplingParams(), prompt="hi", arrival=3, parent=parent)
    assert (seq.seq_id, seq.request_id, seq.prompt, seq.arrival, seq.parent) == (41, "req", "hi", 3, parent)


def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert cdiv(7, 1) == 7 and cdiv(7, 7) == 1


def test_ready_output():
    out = ModelOutput(SamplerOutput([1], [], [None]), [])
    assert ReadyOutput(out).result() is out
