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


def _agrees(extend, case) -> bool:
    """The rule: ``extend`` appends exactly the per-position slots of the chunk, after what is there."""
    block_size, table, start, end = case
    got = [7]
    extend(got, table, start, end, block_size)
    return got == [7] + [_slot(table, p, block_size) for p in range(start, end)]


@settings(max_examples=300, deadline=None)
@given(chunks())
def test_block_ranges_equal_the_per_position_slots(case):
    assert _agrees(_extend_slots, case)


def _last_block_short(slots, table, start, end, block_size):
    """A plausible bug: each block's range stops one slot early when the chunk ends inside it."""
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size - b * block_size
        slots.extend(range(base + max(start, b * block_size), base + min(end - 1, (b + 1) * block_size)))


def _first_block_from_its_start(slots, table, start, end, block_size):
    """Another: the first block's range starts at the block's first slot, not at the chunk's."""
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size - b * block_size
        slots.extend(range(base + b * block_size, base + min(end, (b + 1) * block_size)))


def test_the_rule_refuses_known_bad_ranges():
    """Negative controls: both bugs are refused on a chunk that starts and ends inside blocks."""
    case = (16, [3, 9, 4], 5, 40)
    assert _agrees(_extend_slots, case)
    assert not _agrees(_last_block_short, case)
    assert not _agrees(_first_block_from_its_start, case)
