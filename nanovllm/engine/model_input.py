"""ModelInput: one step's work as plain Python data (picklable, so TP workers get it too).

Built from a SchedulerOutput before the forward pass; it holds no Sequence
objects, only token ids, positions, slots and block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.engine.scheduler import SchedulerOutput


@dataclass
class ModelInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]       # [num_seqs + 1]
    seq_lens: list[int]              # [num_seqs]: computed + new
    block_tables: list[list[int]]
    # sampling: one entry per sequence whose chunk reaches its last token
    sample_rows: list[int] = field(default_factory=list)      # packed row of that last token
    sample_seq_ids: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    output_indices: list[int] = field(default_factory=list)   # index of the token each row samples
    banned_token_ids: list[list[int]] = field(default_factory=list)
    num_logprobs: list[int | None] = field(default_factory=list)
    # prompt logprobs: (seq index, first packed row, target token ids, k)
    prompt_logprob_jobs: list[tuple[int, int, list[int], int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop their generators
    # async scheduling: input rows whose token is still on the device, sampled by the previous
    # step in its sample row pending_src[i]; input_ids holds PLACEHOLDER_TOKEN there
    pending_rows: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


def build_model_input(out: SchedulerOutput, block_size: int,
                      finished_seq_ids: list[int] | None = None) -> ModelInput:
    mi = ModelInput([], [], [], [0], [], [], finished_seq_ids=list(finished_seq_ids or []))
    input_ids, positions, slots, qsl = mi.input_ids, mi.positions, mi.slot_mapping, mi.query_start_loc
    for idx, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + num_new
        table = seq.block_table
        first_row = len(input_ids)
        if num_new == 1:  # the decode fast path: one token, one slot
            if seq.pending_row is not None and start == len(seq.token_ids) - 1:
                mi.pending_rows.append(first_row)
                mi.pending_src.append(seq.pending_row)
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            if seq.pending_row is not None:
                raise RuntimeError(f"{seq}: a prefill chunk over a placeholder token (async scheduling)")
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        qsl.append(len(input_ids))
        mi.seq_lens.append(end)
        mi.block_tables.append(table)
        params = seq.params
        if params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            last = min(end, seq.num_prompt_tokens - 1)
            mi.prompt_logprob_jobs.append(
                (idx, first_row, seq.token_ids[start + 1:last + 1], params.prompt_logprobs))
        if end == len(seq.token_ids):
            mi.sample_rows.append(len(input_ids) - 1)
            mi.sample_seq_ids.append(seq.seq_id)
            mi.temperatures.append(params.temperature)
            mi.top_ks.append(params.top_k)
            mi.top_ps.append(params.top_p)
            mi.min_ps.append(params.min_p)
            mi.seeds.append(params.seed)
            mi.output_indices.append(seq.num_output_tokens)
            banned = sorted(seq.stop_token_ids) if seq.num_output_tokens < params.min_tokens else []
            mi.banned_token_ids.append(banned)
            mi.num_logprobs.append(params.logprobs)
    return mi
