"""AttentionMetadata: everything an attention layer needs to know about one forward call.

It is built by the ModelRunner for exactly one forward and passed down explicitly
(no module-level context). Tokens of all sequences are packed along one axis:
sequence i owns query rows ``query_start_loc[i] : query_start_loc[i+1]``, which
are its positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token; -1 = write nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies (Python ints), so the CPU path never syncs on device tensors
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def num_leading_decodes(self) -> int:
        """How many sequences from the first have one query token each (a mixed step's running
        decodes, which the scheduler puts first); counted once per step, on the host."""
        qsl = self.query_start_loc_cpu
        n = 0
        while n < len(qsl) - 1 and qsl[n + 1] - qsl[n] == 1:
            n += 1
        return n
