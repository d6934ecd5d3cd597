"""Scheduler: decides what one step computes. Pure Python: no torch.

One step is a list of (sequence, number of new tokens). There is no separate
prefill or decode phase: a running sequence asks for all of its tokens that are
not computed yet (one, when it is decoding), a waiting one for its prompt minus
its prefix-cache hits. With chunked prefill a request takes what is left of the
token budget and continues next step; without it, a prompt is scheduled whole
(only a preempted sequence that outgrew the whole budget resumes in chunks).

Order: running sequences first, in admission order, then waiting ones (FIFO).
When a running sequence cannot get a block, the most recently admitted running
sequence is preempted (recompute: its blocks are freed and it goes back to the
front of the queue, keeping its generated tokens); a step that preempts admits
no one. A sequence that is alone always fits: ``add`` refuses any request whose
worst case needs more blocks than the whole cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_cache_hit_tokens = 0
        self.num_cache_query_tokens = 0

    # --------------------------------------------------------------- requests
    def max_blocks_needed(self, seq: Sequence) -> int:
        """Blocks seq holds at worst: K/V of every token but the last sampled one."""
        max_tokens = seq.params.max_tokens if seq.params.max_tokens is not None else self.max_model_len
        final_len = min(seq.num_prompt_tokens + max_tokens, self.max_model_len)
        return self.block_manager.blocks_needed(final_len - 1)

    def check_admissible(self, seq: Sequence) -> None:
        """Raise ValueError for a request that could never run (admission control)."""
        n = seq.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}; shorten it below {self.max_model_len} tokens"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt is {n} tokens > max_num_batched_tokens={self.max_num_batched_tokens} "
                f"with enable_chunked_prefill=False"
            )
        need = self.max_blocks_needed(seq)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs up to {need} KV blocks (prompt {n} tokens + "
                f"max_tokens={seq.params.max_tokens}, block_size={self.block_manager.block_size}) "
                f"but the whole cache has num_kvcache_blocks={self.block_manager.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    # ------------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self._preemption_victim()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.get_computed_blocks(seq)
            num_cached = len(hits) * bm.block_size
            num_new = self._admission_chunk(seq.num_tokens - num_cached, budget)
            if num_new == 0 or not bm.allocate_slots(seq, num_new, hits):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
            self.num_cache_hit_tokens += num_cached
            self.num_cache_query_tokens += seq.num_tokens
            self.running.append(seq)
            out.admitted.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def _admission_chunk(self, num_remaining: int, budget: int) -> int:
        """How many of a waiting sequence's uncached tokens this step computes (0: it waits).

        What the budget allows; without chunked prefill a prompt goes whole or waits, but a
        recompute (after preemption) longer than the whole budget never could go whole, so it
        resumes in chunks like a running sequence."""
        if not self.enable_chunked_prefill and num_remaining > budget and num_remaining <= self.max_num_batched_tokens:
            return 0
        return min(num_remaining, budget)

    def _preemption_victim(self) -> Sequence:
        """Take the running sequence to preempt off ``running``: the most recently admitted one
        (so never one scheduled earlier in this step: those come before it in admission order)."""
        return self.running.pop()

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record that the step's K/V is computed, then publish full blocks' hashes."""
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue  # async scheduling: it stopped while this step was in flight
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)

    def check_invariants(self) -> None:
        live = list(self.running)
        assert not (set(map(id, live)) & set(map(id, self.waiting))), "a request both waiting and running"
        assert len(self.running) <= self.max_num_seqs, "running > max_num_seqs"
        for seq in self.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0, f"waiting {seq} holds blocks"
            assert seq.status is SequenceStatus.WAITING
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
        self.block_manager.check_invariants(live)
