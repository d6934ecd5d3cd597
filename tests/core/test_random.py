"""Property tests (hypothesis) of the core against brute-force references: random admissions,
decodes and frees keep every BlockManager invariant; find_stop_string and banned_by_bad_words
agree with an exhaustive search. (The root conftest's "mutation" profile runs few, fixed examples.)"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nanovllm.core.bad_words import banned_by_bad_words
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.stop import find_stop_string

from .conftest import make_seq

OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decode", "free"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 2), min_size=1, max_size=11),
    ),
    max_size=40,
)


@given(OPS, st.sampled_from([1, 2, 4]), st.booleans())
def test_random_operations_keep_the_invariants(ops, block_size, caching):
    bm = BlockManager(12, block_size, enable_prefix_caching=caching)
    live = []
    for op, pick, tokens in ops:
        if op == "admit":
            seq = make_seq(tokens)
            hits = bm.get_computed_blocks(seq)
            cached = len(hits) * block_size
            assert cached < seq.num_tokens
            assert all(h.token_ids == tuple(tokens[i * block_size : (i + 1) * block_size]) for i, h in enumerate(hits))
            free_before = bm.num_free_blocks
            if bm.allocate_slots(seq, seq.num_tokens - cached, hits):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
            else:
                assert seq.block_table == [] and bm.num_free_blocks == free_before
        elif op == "decode" and live:
            seq = live[pick % len(live)]
            seq.append_token(tokens[0])
            if bm.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
            else:
                seq.token_ids.pop()
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        bm.check_invariants(live)
        used = {b for s in live for b in s.block_table}
        assert bm.num_free_blocks == bm.num_blocks - len(used)
        assert all(len(s.block_table) == bm.blocks_needed(s.num_tokens) for s in live)
        if not caching:
            assert bm.cached == {}


def stop_reference(text: str, num_new: int, stops: list[str]):
    """Every occurrence of every stop string that ends inside the new characters; the earliest
    start wins, ties to the first listed."""
    found = [
        (i, k, s)
        for k, s in enumerate(stops)
        for i in range(len(text) - len(s) + 1)
        if text[i : i + len(s)] == s and i + len(s) > len(text) - num_new
    ]
    return min(found)[0::2] if found else None


@given(st.text("ab", max_size=9), st.integers(0, 9), st.lists(st.text("ab", min_size=1, max_size=3), max_size=3))
def test_find_stop_string_matches_exhaustive_search(text, num_new, stops):
    assert find_stop_string(text, min(num_new, len(text)), stops) == stop_reference(
        text, min(num_new, len(text)), stops
    )


def bad_words_reference(words, output):
    return [w[-1] for w in words if any(tuple(output[j:]) == tuple(w[:-1]) for j in range(len(output) + 1))]


@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), max_size=4), st.lists(st.integers(0, 2), max_size=5)
)
def test_banned_by_bad_words_matches_the_definition(words, output):
    assert banned_by_bad_words(words, output) == bad_words_reference(words, output)
