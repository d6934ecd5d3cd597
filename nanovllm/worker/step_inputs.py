"""StepInputs: a step's integer inputs staged in pinned host memory, one host->device copy.

Layout of a step with T tokens, S sequences and block-table width W (sections
8-byte aligned, in this order)::

    input_ids i64[T] | positions i64[T] | slot_mapping i64[T] |
    query_start_loc i32[S+1] | seq_lens i32[S] | block_tables i32[S*W] | sample_rows i64[*]

Offsets depend on (T, S, W) only, so a decode CUDA graph captured for batch B
(T = S = B, W = max_blocks) reads the same device addresses at every replay:
staging a step *is* updating the graph's persistent input buffers.

Invariants: the pinned buffer is rewritten only after the previous step's copy
has completed (an event guards it); device readers are queued after the copy on
the same stream. Padding rows (decode graphs) have token 0, position 0, slot -1
(writes nothing), seq_len 0 (attends to nothing) and block table row 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.core.model_input import ModelInput
from nanovllm.core.utils import cdiv


def _align(n: int) -> int:
    return cdiv(n, 8) * 8


def _layout(t: int, s: int, w: int) -> dict[str, tuple[int, int, type]]:
    """name -> (byte offset, element count, numpy dtype); sample_rows is open-ended."""
    out, off = {}, 0
    for name, count, dtype in (
        ("input_ids", t, np.int64),
        ("positions", t, np.int64),
        ("slot_mapping", t, np.int64),
        ("query_start_loc", s + 1, np.int32),
        ("seq_lens", s, np.int32),
        ("block_tables", s * w, np.int32),
    ):
        out[name] = (off, count, dtype)
        off = _align(off + count * np.dtype(dtype).itemsize)
    out["sample_rows"] = (off, 0, np.int64)
    return out  # type: ignore[return-value]


@dataclass
class StagedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | slice  # rows of the hidden states that sample


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size = block_size
        lay = _layout(max_tokens, max_seqs, max_blocks)
        self.capacity = lay["sample_rows"][0] + 8 * max_seqs
        cuda = torch.device(device).type == "cuda"  # a CPU instance (tests) skips pinning and events
        self.host = torch.zeros(self.capacity, dtype=torch.uint8, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(self.capacity, dtype=torch.uint8, device=device)
        self.copied = torch.cuda.Event() if cuda else None
        if cuda:
            self.copied.record()  # type: ignore[union-attr]  # an Event on CUDA

    def _host(self, lay, name: str, count: int | None = None) -> np.ndarray:
        off, n, dtype = lay[name]
        n = n if count is None else count
        return self.host_np[off : off + n * np.dtype(dtype).itemsize].view(dtype)

    def _dev(self, lay, name: str, dtype: torch.dtype, count: int | None = None) -> torch.Tensor:
        off, n, _ = lay[name]
        n = n if count is None else count
        return self.dev[off : off + n * dtype.itemsize].view(dtype)

    def stage(self, mi: ModelInput, pad_to: int | None = None) -> StagedStep:
        """Write ``mi`` (a decode batch padded to ``pad_to`` rows, if given), copy it once,
        and return device views of it."""
        lay, s, w = self._write(mi, pad_to)
        b, n, rows = len(mi.seq_lens), mi.num_tokens, mi.sample_rows
        qsl = self._host(lay, "query_start_loc")
        meta = AttentionMetadata(
            slot_mapping=self._dev(lay, "slot_mapping", torch.int64),
            query_start_loc=self._dev(lay, "query_start_loc", torch.int32),
            seq_lens=self._dev(lay, "seq_lens", torch.int32),
            block_tables=self._dev(lay, "block_tables", torch.int32).view(s, w),
            max_query_len=1 if n == b else int(np.diff(qsl[: b + 1]).max()),
            max_seq_len=max(mi.seq_lens),
            block_size=self.block_size,
            query_start_loc_cpu=mi.query_start_loc,
            seq_lens_cpu=mi.seq_lens,
        )
        return StagedStep(
            self._dev(lay, "input_ids", torch.int64),
            self._dev(lay, "positions", torch.int64),
            meta,
            self._sample_rows(lay, rows),
        )

    def stage_for_graph(self, mi: ModelInput, batch: int) -> tuple[torch.Tensor | slice, torch.Tensor]:
        """Write and copy a decode step padded to ``batch`` rows into the addresses the graph
        of that size was captured over; -> (the rows that sample, the device input ids)."""
        lay, _, _ = self._write(mi, batch)
        return self._sample_rows(lay, mi.sample_rows), self._dev(lay, "input_ids", torch.int64)

    def _sample_rows(self, lay, rows: list[int]) -> torch.Tensor | slice:
        if rows == list(range(len(rows))):
            return slice(0, len(rows))
        return self._dev(lay, "sample_rows", torch.int64, len(rows))

    def _write(self, mi: ModelInput, pad_to: int | None):
        b, n = len(mi.seq_lens), mi.num_tokens
        lengths = np.fromiter(map(len, mi.block_tables), dtype=np.int64, count=b)
        widest = int(lengths.max())
        if pad_to is None:
            t, s, w = n, b, max(1, widest)
        else:
            if n != b or pad_to < b:
                raise ValueError(
                    f"pad_to={pad_to} needs a decode batch of at most that many rows, got {n} tokens for {b} sequences"
                )
            t, s, w = pad_to, pad_to, self.max_blocks
        if t > self.max_tokens or s > self.max_seqs or widest > self.max_blocks:
            raise ValueError(
                f"step does not fit the staging buffers: {n} tokens (max {self.max_tokens}), "
                f"{b} seqs (max {self.max_seqs}), {widest} blocks per seq (max {self.max_blocks})"
            )
        lay = _layout(t, s, w)
        rows = mi.sample_rows
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has finished reading the pinned buffer
        for name, values, fill in (
            ("input_ids", mi.input_ids, 0),
            ("positions", mi.positions, 0),
            ("slot_mapping", mi.slot_mapping, -1),
            ("seq_lens", mi.seq_lens, 0),
        ):
            arr = self._host(lay, name)
            arr[: len(values)] = values
            arr[len(values) :] = fill
        qsl = self._host(lay, "query_start_loc")
        qsl[: b + 1] = mi.query_start_loc
        qsl[b + 1 :] = np.arange(n + 1, n + 1 + s - b)  # padding rows: one token each
        tables = self._host(lay, "block_tables").reshape(s, w)
        tables[:] = 0
        # row-major boolean assignment fills row i's first len(table_i) entries, in order
        tables[:b][np.arange(w) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(mi.block_tables), dtype=np.int32, count=int(lengths.sum())
        )
        nbytes = lay["sample_rows"][0]
        if rows != list(range(len(rows))):
            self._host(lay, "sample_rows", len(rows))[:] = rows
            nbytes += 8 * len(rows)
        self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return lay, s, w

    def padding_batch(self, batch: int) -> StagedStep:
        """Stage a decode batch of ``batch`` padding rows: the views a graph is captured over."""
        mi = ModelInput(
            [0] * batch,
            [0] * batch,
            [-1] * batch,
            list(range(batch + 1)),
            [0] * batch,
            [[] for _ in range(batch)],
            sample_rows=list(range(batch)),
        )
        return self.stage(mi, pad_to=batch)
