"""ModelInput: one step's work as plain Python data (picklable, so TP workers get it too).

``build_model_input`` turns a SchedulerOutput into a ModelInput -- token ids, positions,
slots, block tables, per-row sampling settings: no Sequence objects -- and a StepPlan, the
host-side half the engine keeps: which sequence each sample row and each prompt-logprob job
belongs to. Both are decided here once; nothing downstream re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.core.bad_words import banned_by_bad_words
from nanovllm.core.scheduler import SchedulerOutput
from nanovllm.core.sequence import Sequence


@dataclass
class RowLogitsProcessing:
    """One sample row's logits processing beyond temperature and the filters (vLLM's meanings,
    see SamplingParams). Built only for rows that use any, so plain rows cost nothing; bad
    words travel as banned tokens (``ModelInput.banned_token_ids``) instead."""

    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # with a penalty: the request's tokens so far (never a placeholder: the engine waits for them)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None


@dataclass
class ModelInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]: computed + new
    block_tables: list[list[int]]
    # [num_seqs]: the sequence of each entry of seq_lens / block_tables. The model runner does not
    # read it; an executor that keeps per-sequence state does (the fake one of the property tests
    # checks every row against its own record of the sequence): rows of a prefill chunk that
    # samples nothing carry no other id, and prefix-cache hits share block tables
    seq_ids: list[int] = field(default_factory=list)
    # sampling: one entry per sequence whose chunk reaches its last token
    sample_rows: list[int] = field(default_factory=list)  # packed row of that last token
    sample_seq_ids: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    output_indices: list[int] = field(default_factory=list)  # index of the token each row samples
    banned_token_ids: list[list[int]] = field(default_factory=list)
    # sample index -> its logits processing; only the rows that have some
    logits_processing: dict[int, RowLogitsProcessing] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)
    # prompt logprobs: (first packed row, target token ids, k); row r scores target r
    prompt_logprob_jobs: list[tuple[int, list[int], int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop their generators
    # async scheduling: input rows whose token is still on the device, sampled by the previous
    # step in its sample row pending_src[i]; input_ids holds 0 there until the device fills it
    pending_rows: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepPlan:
    """The host-side half of a step: what the engine needs to apply the step's output."""

    sched: SchedulerOutput
    starts: list[int]  # each scheduled sequence's num_computed_tokens before the step
    samplers: list[Sequence]  # the sequences that sample, in sample-row order
    # per prompt-logprob job, in job order: (sequence, prompt position of the job's first target)
    prompt_logprob_jobs: list[tuple[Sequence, int]]
    # a sampler reads its tokens so far (penalties, bad words): async scheduling must not
    # schedule the next step before this one's tokens are known
    needs_token_history: bool = False


def _slot(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the cache slots of positions start..end-1: one contiguous range per block (a
    prefill step's 8,192 slots in ~40 C-level extends instead of 8,192 Python calls)."""
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size - b * block_size  # slot of position p in block b: base + p
        slots.extend(range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size)))


def build_model_input(
    out: SchedulerOutput, block_size: int, finished_seq_ids: list[int] | None = None
) -> tuple[ModelInput, StepPlan]:
    mi = ModelInput([], [], [], [0], [], [], finished_seq_ids=list(finished_seq_ids or []))
    plan = StepPlan(out, [], [], [])
    input_ids, positions, slots, qsl = mi.input_ids, mi.positions, mi.slot_mapping, mi.query_start_loc
    for seq, num_new in zip(out.seqs, out.num_new_tokens):
        start = seq.num_computed_tokens
        end = start + num_new
        plan.starts.append(start)
        table = seq.block_table
        first_row = len(input_ids)
        known = len(seq.token_ids)  # tokens past this are placeholders (async scheduling)
        if num_new == 1:  # the decode fast path: one token, one slot
            if start >= known:
                mi.pending_rows.append(first_row)
                mi.pending_src.append(seq.pending_row)  # type: ignore[arg-type]  # set while its token is pending
                input_ids.append(0)
            else:
                input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(_slot(table, start, block_size))
        else:
            if end > known:
                raise RuntimeError(f"{seq}: a prefill chunk over a placeholder token (async scheduling)")
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            _extend_slots(slots, table, start, end, block_size)
        qsl.append(len(input_ids))
        mi.seq_lens.append(end)
        mi.block_tables.append(table)
        mi.seq_ids.append(seq.seq_id)
        params = seq.params
        if params.prompt_logprobs is not None:
            # row p scores prompt token p + 1; positions already recorded (before a preemption)
            # are not scored again
            first = max(start, seq.num_prompt_logprobs_recorded - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                mi.prompt_logprob_jobs.append(
                    (first_row + first - start, seq.token_ids[first + 1 : last + 1], params.prompt_logprobs)
                )
                plan.prompt_logprob_jobs.append((seq, first + 1))
        if end == seq.num_tokens:
            plan.samplers.append(seq)
            mi.sample_rows.append(len(input_ids) - 1)
            mi.sample_seq_ids.append(seq.seq_id)
            mi.temperatures.append(params.temperature)
            mi.top_ks.append(params.top_k)
            mi.top_ps.append(params.top_p)
            mi.min_ps.append(params.min_p)
            mi.seeds.append(params.seed)
            mi.output_indices.append(seq.num_output_tokens)
            banned = sorted(seq.stop_token_ids) if seq.num_output_tokens < params.min_tokens else []
            if seq.logits_processing:
                banned = _add_logits_processing(mi, seq, banned)
                plan.needs_token_history |= seq.needs_token_history
            mi.banned_token_ids.append(banned)
            mi.num_logprobs.append(params.logprobs)
    return mi, plan


def _add_logits_processing(mi: ModelInput, seq: Sequence, banned: list[int]) -> list[int]:
    """Record the row's logits processing (the row just appended); return its banned tokens."""
    params = seq.params
    if seq.needs_token_history and seq.num_placeholders:
        raise RuntimeError(
            f"{seq}: penalties or bad words over a placeholder token (the engine must complete the previous step first)"
        )
    if seq.bad_words_token_ids:
        banned = banned + banned_by_bad_words(seq.bad_words_token_ids, seq.token_ids[seq.num_prompt_tokens :])
    row = RowLogitsProcessing(
        params.allowed_token_ids,
        params.logit_bias or None,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
    )
    if params.has_penalties:
        row.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
        row.output_token_ids = seq.token_ids[seq.num_prompt_tokens :]
    if row.allowed_token_ids is not None or row.logit_bias or params.has_penalties:
        mi.logits_processing[len(mi.sample_rows) - 1] = row
    return banned
