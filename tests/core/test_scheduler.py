"""Scheduler: running first in admission order, then FIFO admission within the token budget and
max_num_seqs; chunked prefill; preemption of the most recently admitted; admission control."""

from __future__ import annotations

import pytest

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler, SchedulerOutput
from nanovllm.core.sequence import SequenceStatus

from .conftest import FIRST_LINE, make_seq

BS = 4


def sched(num_blocks=16, max_num_seqs=4, budget=32, max_model_len=64, chunked=True, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked)


def step(s: Scheduler, sample=True):
    """schedule, record the computed K/V, and append a token to each sequence that finished
    its prompt (as the engine does); returns [(request_id, num_new)] and the output."""
    out = s.schedule()
    s.update_after_step(out)
    if sample:
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1)
    s.check_invariants()
    return [(q.request_id, n) for q, n in zip(out.seqs, out.num_new_tokens)], out


def test_admission_is_fifo_and_running_go_first():
    s = sched()
    a, b = make_seq(range(5), "a"), make_seq(range(6), "b")
    s.add(a)
    s.add(b)
    assert s.has_unfinished()
    got, out = step(s)
    assert got == [("a", 5), ("b", 6)] and out.admitted == [a, b] and out.preempted == []
    c = make_seq(range(3), "c")
    s.add(c)
    got, out = step(s)
    assert got == [("a", 1), ("b", 1), ("c", 3)] and out.admitted == [c]
    assert [q.status for q in (a, b, c)] == [SequenceStatus.RUNNING] * 3


def test_token_budget_is_shared_in_order():
    s = sched(budget=8)
    s.add(make_seq(range(6), "a"))
    s.add(make_seq(range(10, 16), "b"))
    got, out = step(s)
    assert got == [("a", 6), ("b", 2)] and out.num_tokens == 8  # b: a chunk
    got, _ = step(s)
    assert got == [("a", 1), ("b", 4)]
    got, _ = step(s)
    assert got == [("a", 1), ("b", 1)]


def test_budget_exhausted_stops_admission():
    s = sched(budget=5)
    s.add(make_seq(range(5), "a"))
    s.add(make_seq(range(2), "b"))
    got, _ = step(s)
    assert got == [("a", 5)] and [q.request_id for q in s.waiting] == ["b"]


def test_budget_exhausted_by_running_sequences():
    """A running sequence left without budget is not scheduled (not even with 0 tokens)."""
    s = sched(budget=3)
    s.add(make_seq(range(1), "a"))
    s.add(make_seq(range(10, 11), "b"))
    s.add(make_seq(range(20, 21), "c"))
    step(s)
    s.max_num_batched_tokens = 2
    got, _ = step(s)
    assert got == [("a", 1), ("b", 1)]


def test_max_num_seqs():
    s = sched(max_num_seqs=2)
    for r in "abc":
        s.add(make_seq(range(3), r))
    got, _ = step(s)
    assert got == [("a", 3), ("b", 3)] and len(s.running) == 2
    s.finish(s.running[0])
    got, _ = step(s)
    assert got == [("b", 1), ("c", 3)]


def test_without_chunked_prefill_a_prompt_goes_whole_or_waits():
    s = sched(budget=8, chunked=False)
    s.add(make_seq(range(6), "a"))
    s.add(make_seq(range(10, 16), "b"))
    got, _ = step(s)
    assert got == [("a", 6)]
    got, _ = step(s)
    assert got == [("a", 1), ("b", 6)]


def test_without_chunked_prefill_a_prompt_that_fits_exactly_goes():
    s = sched(budget=8, chunked=False)
    s.add(make_seq(range(2), "a"))
    s.add(make_seq(range(6), "b"))
    got, _ = step(s)
    assert got == [("a", 2), ("b", 6)]


def test_without_chunked_prefill_a_long_recompute_resumes_in_chunks():
    """A preempted sequence that outgrew the whole budget goes back in chunks."""
    s = sched(budget=8, chunked=False, caching=False)
    seq = make_seq(range(7), "a", max_tokens=20)
    s.add(seq)
    step(s)
    for _ in range(3):
        step(s)
    assert seq.num_tokens == 11
    s._preempt(s._preemption_victim())
    got, _ = step(s)
    assert got == [("a", 8)]
    got, _ = step(s)
    assert got == [("a", 3)]


def test_without_chunked_prefill_a_recompute_of_exactly_the_budget_waits_for_all_of_it():
    s = sched(budget=8, chunked=False, caching=False)
    a = make_seq(range(1), "a", max_tokens=20)
    b = make_seq(range(10, 16), "b", max_tokens=20)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert b.num_tokens == 8
    s._preempt(s._preemption_victim())
    got, _ = step(s)  # 7 tokens of budget left: b (8) could go whole later
    assert got == [("a", 1)]


def test_chunked_prefill_is_the_default():
    s = Scheduler(BlockManager(16, BS), 4, 4, 64)
    s.add(make_seq(range(6), "a"))
    assert s.schedule().num_new_tokens == [4]


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    s = sched(num_blocks=4, max_model_len=16)
    a = make_seq(range(7), "a", max_tokens=8)
    b = make_seq(range(7), "b", max_tokens=8)
    c = make_seq(range(2), "c", max_tokens=2)
    for q in (a, b, c):
        s.add(q)
    got, _ = step(s)  # a, b: 2 blocks each (8 tokens), c waits for a block
    assert got == [("a", 7), ("b", 7)]
    got, out = step(s)  # a: position 7 (its block), b likewise: no one admitted
    assert got == [("a", 1), ("b", 1)]
    got, out = step(s)  # a needs a 3rd block: b (last admitted) is preempted
    assert got == [("a", 1)] and out.preempted == [b] and out.admitted == []
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert (b.num_preemptions, s.num_preemptions) == (1, 1)
    assert [q.request_id for q in s.waiting] == ["b", "c"]
    assert b.token_ids[7:] == [1, 1]  # its generated tokens are kept


def test_a_sequence_preempts_itself_when_alone_short_of_blocks():
    s = sched(num_blocks=3, max_model_len=16)
    a = make_seq(range(8), "a", max_tokens=4)
    b = make_seq(range(4), "b", max_tokens=2)
    s.add(a)
    s.add(b)
    got, _ = step(s)
    assert got == [("a", 8), ("b", 4)]  # 2 + 1 blocks: the cache is full
    got, out = step(s)  # a needs a third block: b goes; b's position 4 too
    assert got == [("a", 1)] and out.preempted == [b]


def test_victim_preempting_itself_ends_the_loop():
    s = sched(num_blocks=2, max_model_len=16)
    a = make_seq(range(4), "a", max_tokens=4)
    s.add(a)
    step(s)
    # take a block away behind its back so that a cannot grow: it is its own victim
    s.block_manager.free_blocks.popitem()
    s.block_manager.blocks[1].ref_count = 1
    got = s.schedule()
    assert got.preempted == [a] and got.seqs == [] and list(s.waiting) == [a] and s.running == []


def test_cache_hit_statistics_and_num_cached_tokens():
    s = sched()
    a = make_seq(range(9), "a")
    s.add(a)
    step(s)
    b = make_seq(list(range(8)) + [40, 41], "b")
    s.add(b)
    got, _out = step(s)
    assert got == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert b.num_computed_tokens == 10
    assert (s.num_cache_hit_tokens, s.num_cache_query_tokens) == (8, 19)


def test_num_cached_tokens_is_kept_from_the_first_admission():
    s = sched(num_blocks=8)
    a = make_seq(range(9), "a")
    s.add(a)
    step(s)
    s._preempt(s._preemption_victim())
    got, _ = step(s)
    assert got == [("a", 2)]  # 8 of its 10 tokens hit its own freed blocks
    assert a.num_cached_tokens == 0 and s.num_cache_hit_tokens == 8
    s._preempt(s._preemption_victim())
    got, _ = step(s)
    assert got == [("a", 3)]
    assert s.num_cache_hit_tokens == 16 and (a.num_preemptions, s.num_preemptions) == (2, 2)


def test_update_after_step_skips_finished_sequences():
    s = sched()
    a, b = make_seq(range(5), "a"), make_seq(range(5), "b")
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.finish(a)
    s.update_after_step(out)
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 5
    assert len(s.block_manager.cached) == 1


def test_finish_frees_and_removes():
    s = sched()
    a, b = make_seq(range(5), "a"), make_seq(range(5), "b")
    s.add(a)
    step(s)
    s.add(b)
    s.finish(b)  # waiting
    s.finish(a)  # running
    assert a.is_finished and b.is_finished and not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 16 and a.block_table == []
    done = make_seq(range(2))
    done.status = SequenceStatus.FINISHED
    s.finish(done)  # finishing twice is harmless
    assert done.is_finished


def test_empty_schedule():
    s = sched()
    out = s.schedule()
    assert out.is_empty and out.num_tokens == 0
    assert not s.has_unfinished()


def test_scheduler_output_defaults_are_independent():
    one, two = SchedulerOutput(), SchedulerOutput()
    one.seqs.append(1)
    assert two.seqs == [] and two.num_new_tokens == [] and two.preempted == [] and two.admitted == []


# ---------------------------------------------------------------- admission control
def test_prompt_must_leave_room_to_generate():
    s = sched(max_model_len=8)
    with pytest.raises(
        ValueError,
        match="prompt is 8 tokens, which leaves no room to generate within max_model_len=8; shorten it below 8 tokens",
    ):
        s.add(make_seq(range(8)))
    s.add(make_seq(range(7)))
    assert len(s.waiting) == 1


def test_prompt_over_the_budget_without_chunked_prefill():
    s = sched(budget=8, chunked=False)
    with pytest.raises(
        ValueError, match="prompt is 9 tokens > max_num_batched_tokens=8 with enable_chunked_prefill=False"
    ):
        s.add(make_seq(range(9)))
    s.add(make_seq(range(8)))
    sched(budget=8, chunked=True).add(make_seq(range(9)))


def test_request_larger_than_the_cache():
    s = sched(num_blocks=2, max_model_len=64)
    with pytest.raises(
        ValueError,
        match=r"request 'big' needs up to 3 KV blocks \(prompt 4 tokens \+ "
        r"max_tokens=6, block_size=4\) but the whole cache has "
        r"num_kvcache_blocks=2",
    ):
        s.add(make_seq(range(4), "big", max_tokens=6))
    s.add(make_seq(range(4), "fits", max_tokens=5))  # 8 tokens, the last one needs no K/V


@pytest.mark.parametrize(
    "prompt,max_tokens,max_model_len,blocks",
    [
        (4, 5, 64, 2),
        (4, 6, 64, 3),
        (4, None, 12, 3),
        (4, None, 13, 3),
        (4, None, 14, 4),
        (4, 100, 10, 3),
        (1, 1, 64, 1),
        (1, 2, 64, 1),
        (4, 1, 64, 1),
        (4, 2, 64, 2),
    ],
)
def test_max_blocks_needed(prompt, max_tokens, max_model_len, blocks):
    s = sched(max_model_len=max_model_len)
    assert s.max_blocks_needed(make_seq(range(prompt), max_tokens=max_tokens)) == blocks


# ---------------------------------------------------------------- check_invariants catches
def test_check_invariants_catches():
    s = sched(max_num_seqs=1)
    a = make_seq(range(3), "a")
    s.add(a)
    step(s)
    s.waiting.append(a)
    with pytest.raises(AssertionError, match=FIRST_LINE.format("a request both waiting and running")):
        s.check_invariants()
    s.waiting.clear()
    s.running.append(make_seq(range(1)))
    with pytest.raises(AssertionError, match=FIRST_LINE.format("running > max_num_seqs")):
        s.check_invariants()
    s.running.pop()
    b = make_seq(range(3))
    b.block_table = [5]
    s.waiting.append(b)
    with pytest.raises(AssertionError, match="holds blocks"):
        s.check_invariants()
    b.block_table = []
    b.num_computed_tokens = 1
    with pytest.raises(AssertionError, match="holds blocks"):
        s.check_invariants()
    b.num_computed_tokens = 0
    b.status = SequenceStatus.RUNNING
    with pytest.raises(AssertionError):
        s.check_invariants()
    s.waiting.clear()
    a.status = SequenceStatus.WAITING
    with pytest.raises(AssertionError):
        s.check_invariants()
    a.status = SequenceStatus.RUNNING
    s.check_invariants()
    a.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError, match="repeats a block"):
        s.check_invariants()


def test_admission_takes_the_last_token_of_the_budget():
    """A decode takes 1 of a 2-token budget: the waiting request still gets a 1-token chunk."""
    s = sched()
    s.add(make_seq(range(3), "a"))
    step(s)  # a's prefill
    s.max_num_batched_tokens = 2
    s.add(make_seq(range(10, 13), "b"))
    got, _ = step(s)
    assert got == [("a", 1), ("b", 1)]
