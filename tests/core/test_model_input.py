"""build_model_input: packed rows, positions and slots through the block table, sample rows and
their settings, placeholders (async scheduling), prompt-logprob jobs, logits processing."""

from __future__ import annotations

import pytest

from nanovllm.core.model_input import ModelInput, RowLogitsProcessing, build_model_input
from nanovllm.core.scheduler import SchedulerOutput

from .conftest import make_seq

BS = 4


def seq_at(tokens, computed, table, **kw):
    seq = make_seq(tokens, **kw)
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def build(pairs, finished=None):
    out = SchedulerOutput(seqs=[s for s, _ in pairs], num_new_tokens=[n for _, n in pairs])
    return build_model_input(out, BS, finished)


def test_prefill_and_decode_rows():
    a = seq_at([10, 11, 12, 13, 14, 15], 0, [7, 2])  # prefill 6 tokens
    b = seq_at([20, 21, 22, 23, 24], 4, [5, 9])  # decode position 4
    mi, plan = build([(a, 6), (b, 1)], finished=[3])
    assert mi.input_ids == [10, 11, 12, 13, 14, 15, 24]
    assert mi.positions == [0, 1, 2, 3, 4, 5, 4]
    assert mi.slot_mapping == [28, 29, 30, 31, 8, 9, 36]
    assert mi.query_start_loc == [0, 6, 7] and mi.seq_lens == [6, 5]
    assert mi.block_tables == [[7, 2], [5, 9]] and mi.seq_ids == [a.seq_id, b.seq_id]
    assert mi.sample_rows == [5, 6] and mi.sample_seq_ids == [a.seq_id, b.seq_id]
    assert mi.output_indices == [0, 0 + 5 - 5] and mi.num_tokens == 7
    assert mi.finished_seq_ids == [3] and mi.pending_rows == [] and mi.pending_src == []
    assert plan.starts == [0, 4] and plan.samplers == [a, b] and plan.sched.seqs == [a, b]
    assert plan.prompt_logprob_jobs == [] and not plan.needs_token_history


def test_chunk_that_does_not_reach_the_end_samples_nothing():
    a = seq_at(list(range(10)), 3, [1, 2, 3])
    mi, plan = build([(a, 5)])
    assert mi.input_ids == [3, 4, 5, 6, 7] and mi.positions == [3, 4, 5, 6, 7]
    assert mi.slot_mapping == [7, 8, 9, 10, 11] and mi.seq_lens == [8]
    assert mi.sample_rows == [] and plan.samplers == [] and mi.temperatures == []
    assert mi.finished_seq_ids == []


def test_sampling_settings_per_row():
    a = seq_at([1, 2, 3], 0, [0], temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=7, logprobs=2)
    b = seq_at([1, 2, 3, 4, 5], 4, [1, 2])
    b.token_ids.append(6)  # b has output tokens 5, 6... (prompt 5)
    b.num_computed_tokens = 5
    mi, _ = build([(a, 3), (b, 1)])
    assert mi.temperatures == [0.5, 1.0] and mi.top_ks == [3, 0] and mi.top_ps == [0.9, 1.0]
    assert mi.min_ps == [0.1, 0.0] and mi.seeds == [7, None] and mi.num_logprobs == [2, None]
    assert mi.output_indices == [0, 1]
    assert mi.banned_token_ids == [[], []] and mi.logits_processing == {}


def test_stop_tokens_banned_before_min_tokens():
    a = seq_at([1, 2], 0, [0], min_tokens=2, stop_token_ids=[9, 4], eos=[7])
    mi, _ = build([(a, 2)])
    assert mi.banned_token_ids == [[4, 7, 9]]
    a.token_ids.append(5)
    a.num_computed_tokens = 2
    mi, _ = build([(a, 1)])
    assert mi.banned_token_ids == [[4, 7, 9]]  # output index 1 < 2
    a.token_ids.append(5)
    a.num_computed_tokens = 3
    mi, _ = build([(a, 1)])
    assert mi.banned_token_ids == [[]]  # output index 2: a stop token may come


def test_placeholder_decode_reads_the_previous_sample_row():
    a = seq_at([1, 2, 3], 3, [4])
    a.add_placeholder(5)
    mi, _plan = build([(a, 1)])
    assert mi.input_ids == [0] and mi.pending_rows == [0] and mi.pending_src == [5]
    assert mi.positions == [3] and mi.slot_mapping == [19] and mi.sample_rows == [0]
    assert mi.output_indices == [1]


def test_placeholder_row_is_the_packed_row():
    a = seq_at([1, 2, 3], 0, [0])
    b = seq_at([1, 2, 3], 3, [4])
    b.add_placeholder(2)
    mi, _ = build([(a, 3), (b, 1)])
    assert mi.pending_rows == [3] and mi.input_ids == [1, 2, 3, 0]


def test_prefill_over_a_placeholder_is_refused():
    a = seq_at([1, 2, 3], 2, [4])
    a.add_placeholder(0)
    with pytest.raises(RuntimeError, match="a prefill chunk over a placeholder token"):
        build([(a, 2)])


def test_prefill_up_to_the_known_tokens_is_fine():
    a = seq_at([1, 2, 3], 1, [4])
    mi, _ = build([(a, 2)])
    assert mi.input_ids == [2, 3]


def test_prompt_logprob_jobs():
    a = seq_at([10, 11, 12, 13, 14, 15], 0, [0, 1], prompt_logprobs=3, max_tokens=4)
    mi, plan = build([(a, 4)])  # rows 0..3 score prompt tokens 1..4
    assert mi.prompt_logprob_jobs == [(0, [11, 12, 13, 14], 3)]
    assert plan.prompt_logprob_jobs == [(a, 1)]
    a.num_computed_tokens = 4
    mi, plan = build([(a, 2)])  # row 4 scores token 5; row 5 (last) samples
    assert mi.prompt_logprob_jobs == [(0, [15], 3)] and plan.prompt_logprob_jobs == [(a, 5)]
    a.num_computed_tokens = 6
    a.append_token(16)
    mi, plan = build([(a, 1)])  # decode: nothing left to score
    assert mi.prompt_logprob_jobs == [] and plan.prompt_logprob_jobs == []


def test_prompt_logprob_jobs_skip_positions_already_recorded():
    """After a preemption the recompute does not score recorded positions again."""
    a = seq_at([10, 11, 12, 13, 14, 15], 0, [0, 1], prompt_logprobs=0)
    a.prompt_logprobs.extend([(11, None), (12, None), (13, None)])  # positions 1..3 recorded
    b = seq_at([1, 2], 0, [3])
    mi, plan = build([(b, 2), (a, 6)])
    assert mi.prompt_logprob_jobs == [(2 + 3, [14, 15], 0)] and plan.prompt_logprob_jobs == [(a, 4)]
    a.prompt_logprobs.extend([(14, None), (15, None)])
    mi, plan = build([(a, 6)])
    assert mi.prompt_logprob_jobs == []


def test_logits_processing_rows():
    plain = seq_at([1, 2], 0, [0])
    bias = seq_at([1, 2], 0, [1], logit_bias={5: 2.0}, allowed_token_ids=[5, 6])
    pen = seq_at([1, 2], 0, [2], repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=-0.5)
    mi, plan = build([(plain, 2), (bias, 2), (pen, 2)])
    assert set(mi.logits_processing) == {1, 2}
    assert mi.logits_processing[1] == RowLogitsProcessing([5, 6], {5: 2.0})
    assert mi.logits_processing[2] == RowLogitsProcessing(None, None, 1.5, 0.5, -0.5, [1, 2], [])
    assert plan.needs_token_history


def test_allowed_tokens_alone_make_a_row():
    only = seq_at([1, 2], 0, [0], allowed_token_ids=[3])
    mi, plan = build([(only, 2)])
    assert mi.logits_processing == {0: RowLogitsProcessing([3])} and not plan.needs_token_history


def test_token_history_need_is_kept_over_later_rows():
    pen = seq_at([1, 2], 0, [0], presence_penalty=0.5)
    bias = seq_at([1, 2], 0, [1], logit_bias={4: 1.0})
    _, plan = build([(pen, 2), (bias, 2)])
    assert plan.needs_token_history


def test_logits_processing_row_records_the_tokens_so_far():
    pen = seq_at([1, 2], 2, [0], frequency_penalty=1.0)
    pen.token_ids.extend([3])
    mi, _ = build([(pen, 1)])
    row = mi.logits_processing[0]
    assert (row.prompt_token_ids, row.output_token_ids) == ([1, 2], [3])
    assert (row.repetition_penalty, row.presence_penalty, row.frequency_penalty) == (1.0, 0.0, 1.0)


def test_bad_words_become_banned_tokens():
    a = seq_at([1, 2], 0, [0], bad_words=[[8], [3, 9]], min_tokens=1, stop_token_ids=[4])
    # only the engine knows the tokenization; bad_words in params make has_logits_processing true
    a.params.bad_words = ["x"]
    a.logits_processing = True
    mi, plan = build([(a, 2)])
    assert mi.banned_token_ids == [[4, 8]] and mi.logits_processing == {}
    assert plan.needs_token_history  # a multi-token bad word reads the output
    a.token_ids.append(3)
    a.num_computed_tokens = 2
    mi, _ = build([(a, 1)])
    assert mi.banned_token_ids == [[8, 9]]  # the output ends with 3: 9 is banned too


def test_bad_words_prefix_is_matched_in_the_output_only():
    a = seq_at([1, 3], 0, [0], bad_words=[[3, 9]])
    a.logits_processing = True
    mi, _ = build([(a, 2)])
    assert mi.banned_token_ids == [[]]


def test_single_token_bad_words_need_no_history():
    a = seq_at([1, 2], 0, [0], bad_words=[[8]])
    a.logits_processing = True
    a.add_placeholder(0)
    a.num_computed_tokens = 2
    mi, plan = build([(a, 1)])
    assert mi.banned_token_ids == [[8]] and not plan.needs_token_history


def test_penalties_over_a_placeholder_are_refused():
    a = seq_at([1, 2], 2, [0], presence_penalty=1.0)
    a.add_placeholder(0)
    with pytest.raises(RuntimeError, match="penalties or bad words over a placeholder token"):
        build([(a, 1)])


def test_model_input_defaults_are_independent():
    one, two = ModelInput([], [], [], [0], [], []), ModelInput([], [], [], [0], [], [])
    one.sample_rows.append(1)
    one.logits_processing[0] = RowLogitsProcessing()
    assert two.sample_rows == [] and two.logits_processing == {}
    assert RowLogitsProcessing() == RowLogitsProcessing(None, None, 1.0, 0.0, 0.0, None, None)
