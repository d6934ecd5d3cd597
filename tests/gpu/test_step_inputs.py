"""StepInputs (the GPU path's staging buffer), exercised on the CPU: what the device
views hold, padding rows, and the fixed addresses decode graphs rely on."""

from __future__ import annotations

import pytest
import torch

from nanovllm.core.model_input import ModelInput
from nanovllm.worker.cuda_graph import graph_batch_sizes
from nanovllm.worker.step_inputs import StepInputs

BS, MAX_BLOCKS = 16, 8


def _inputs() -> StepInputs:
    return StepInputs(max_tokens=64, max_seqs=6, max_blocks=MAX_BLOCKS, block_size=BS, device="cpu")


def _prefill_and_decode() -> ModelInput:
    """Seq 0: 5-token chunk after 20 cached; seq 1: a decode at position 40 (no sampling row
    for seq 0, so the sample rows are not 0..k-1)."""
    return ModelInput(
        input_ids=[11, 12, 13, 14, 15, 16],
        positions=[20, 21, 22, 23, 24, 40],
        slot_mapping=[3 * BS + 4 + i for i in range(5)] + [7 * BS + 8],
        query_start_loc=[0, 5, 6],
        seq_lens=[25, 41],
        block_tables=[[2, 3], [5, 6, 7]],
        sample_rows=[5],
    )


def _decode(lens: list[int]) -> ModelInput:
    tables = [[10 + i] * (-(-(n + 1) // BS)) for i, n in enumerate(lens)]
    return ModelInput(
        [7] * len(lens),
        list(lens),
        [t[0] * BS + n % BS for t, n in zip(tables, lens)],
        list(range(len(lens) + 1)),
        [n + 1 for n in lens],
        tables,
        sample_rows=list(range(len(lens))),
    )


def test_views_hold_the_step():
    mi = _prefill_and_decode()
    step = _inputs().stage(mi)
    m = step.meta
    assert step.input_ids.tolist() == mi.input_ids and step.positions.tolist() == mi.positions
    assert m.slot_mapping.tolist() == mi.slot_mapping and m.slot_mapping.dtype == torch.int64
    assert m.query_start_loc.tolist() == [0, 5, 6] and m.query_start_loc.dtype == torch.int32
    assert m.seq_lens.tolist() == [25, 41] and m.max_query_len == 5 and m.max_seq_len == 41
    assert m.block_tables.tolist() == [[2, 3, 0], [5, 6, 7]] and m.block_tables.dtype == torch.int32
    assert step.sample_rows.tolist() == [5]


def test_padded_decode_rows_write_nothing_and_attend_to_nothing():
    inputs = _inputs()
    step = inputs.stage(_decode([3, 17]), pad_to=4)
    m = step.meta
    assert m.slot_mapping.tolist()[2:] == [-1, -1]
    assert m.seq_lens.tolist() == [4, 18, 0, 0]
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert m.block_tables.shape == (4, MAX_BLOCKS) and m.block_tables[2:].eq(0).all()
    assert step.input_ids.tolist()[2:] == [0, 0] and step.sample_rows == slice(0, 2)


def test_same_padded_size_same_addresses():
    """A graph captured over padding_batch(B) reads what a later padded step of size B wrote."""
    inputs = _inputs()
    captured = inputs.padding_batch(4)
    inputs.stage_for_graph(_decode([1, 2, 30]), 4)
    assert captured.meta.seq_lens.tolist() == [2, 3, 31, 0]
    assert captured.meta.slot_mapping.tolist()[3] == -1
    assert captured.input_ids.tolist() == [7, 7, 7, 0]
    assert captured.meta.block_tables[2, :2].tolist() == [12, 12]
    # a smaller step in between (another layout) does not move the size-4 addresses
    inputs.stage(_prefill_and_decode())
    inputs.stage_for_graph(_decode([5]), 4)
    assert captured.meta.seq_lens.tolist() == [6, 0, 0, 0]


def test_too_large_steps_are_refused_with_the_field():
    inputs = _inputs()
    with pytest.raises(ValueError, match="blocks per seq"):
        inputs.stage(ModelInput([1], [0], [0], [0, 1], [1], [list(range(MAX_BLOCKS + 1))], sample_rows=[0]))
    with pytest.raises(ValueError, match="pad_to"):
        inputs.stage(_prefill_and_decode(), pad_to=4)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16, 45, 100, 256, 257])
def test_graph_sizes_cover_every_batch(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == 1
    assert all(any(s >= b for s in sizes) for b in range(1, max_num_seqs + 1))
