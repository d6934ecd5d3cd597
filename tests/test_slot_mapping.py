"""The slot mapping of a chunk, built one contiguous range per cache block (``_extend_slots``),
equals the per-position formula (``_slot``) for any block size, chunk and block table."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.core.model_input import _extend_slots, _slot


@st.composite
def chunks(draw):
    block_size = draw(st.sampled_from([1, 2, 16, 256]))
    end = draw(st.integers(1, 1200))
    start = draw(st.integers(0, end - 1))
    n_blocks = (end - 1) // block_size + 1
    table = draw(st.lists(st.integers(0, 5000), min_size=n_blocks, max_size=n_blocks, unique=True))
    return block_size, table, start, end


@settings(max_examples=300, deadline=None)
@given(chunks())
def test_block_ranges_equal_the_per_position_slots(case):
    block_size, table, start, end = case
    got = [7]  # appends after what is there
    _extend_slots(got, table, start, end, block_size)
    assert got == [7] + [_slot(table, p, block_size) for p in range(start, end)]


def test_the_comparison_sees_a_chunk_one_position_short():
    """Negative control: the slots of start..end-2 (an off-by-one at the chunk's end) differ."""
    table, got = [3, 9, 4], []
    _extend_slots(got, table, 5, 40, 16)
    short = []
    _extend_slots(short, table, 5, 39, 16)
    assert got != short and got[:-1] == short
