"""BlockManager: ref counts, all-or-nothing allocation, prefix-cache hits along the hash chain,
LRU eviction order, collisions never served, and check_invariants catching broken states."""

from __future__ import annotations

from array import array

import pytest
import xxhash

from nanovllm.core.block_manager import BlockManager, hash_block_tokens

from .conftest import FIRST_LINE, make_seq

BS = 4


def admit(bm: BlockManager, seq, computed: bool = True) -> int:
    """Admit seq as the scheduler does (cache hits, then its other tokens); with ``computed``
    mark its K/V computed and publish its full blocks. Returns the number of hit tokens."""
    hits = bm.get_computed_blocks(seq)
    cached = len(hits) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - cached, hits)
    seq.num_computed_tokens = cached
    if computed:
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    return cached


def decode(bm: BlockManager, seq, token: int) -> bool:
    """One decode step: room for the new token, its K/V computed, full blocks published."""
    seq.append_token(token)
    if not bm.allocate_slots(seq, 1):
        seq.token_ids.pop()
        return False
    seq.num_computed_tokens += 1
    bm.cache_full_blocks(seq)
    return True


# ---------------------------------------------------------------- the hash chain
def test_hash_is_xxh3_of_parent_and_tokens():
    """The chain hash is a stable format (cache keys across processes): xxh3_64 over a tag byte
    (0: first block; 1 + the parent's 8 little-endian bytes) and the tokens as int64."""
    tokens = [1, 2, 3, 300000]
    first = xxhash.xxh3_64_intdigest(b"\x00" + array("q", tokens).tobytes())
    assert hash_block_tokens(None, tokens) == first
    second = xxhash.xxh3_64_intdigest(b"\x01" + first.to_bytes(8, "little") + array("q", [5, 6]).tobytes())
    assert hash_block_tokens(first, (5, 6)) == second


def test_hash_depends_on_parent_and_order():
    h = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(0, [1, 2]) != h
    assert hash_block_tokens(h, [1, 2]) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [2, 1]) != h


def test_update_block_hashes_covers_full_blocks_only():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    bm.update_block_hashes(seq)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert seq.block_hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    seq.append_token(10)
    seq.append_token(11)
    bm.update_block_hashes(seq)
    assert len(seq.block_hashes) == 3
    assert seq.block_hashes[2] == hash_block_tokens(seq.block_hashes[1], [8, 9, 10, 11])


# ---------------------------------------------------------------- construction, queries
@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0), (-1, 4)])
def test_bad_sizes_are_named(num_blocks, block_size):
    with pytest.raises(ValueError, match=rf"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"):
        BlockManager(num_blocks, block_size)


def test_queries():
    bm = BlockManager(1, 1)
    assert bm.num_free_blocks == 1
    bm = BlockManager(4, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    seq = make_seq(range(5))
    admit(bm, seq)
    assert bm.num_free_blocks == 2
    assert bm.enable_prefix_caching and bm.num_evictions == 0
    assert [b.ref_count for b in bm.blocks] == [1, 1, 0, 0]
    assert seq.block_table == [0, 1]
    assert repr(bm.blocks[2]) == "Block(2, ref=0, hash=None)"


# ---------------------------------------------------------------- allocation
def test_allocation_is_all_or_nothing():
    bm = BlockManager(3, BS)
    seq = make_seq(range(13))
    assert not bm.allocate_slots(seq, 13)  # needs 4 blocks
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(seq, 12)
    assert bm.num_free_blocks == 0
    bm.check_invariants([seq])


def test_hits_only_on_admission():
    bm = BlockManager(4, BS)
    admit(bm, make_seq(range(5)))
    seq = make_seq(range(6))
    hits = bm.get_computed_blocks(seq)
    seq.block_table = [3]
    with pytest.raises(AssertionError, match=FIRST_LINE.format("cache hits only on admission")):
        bm.allocate_slots(seq, 1, hits)


def test_hits_alone_take_no_new_block():
    bm = BlockManager(4, BS)
    admit(bm, make_seq(range(9)))
    seq = make_seq(range(9))
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, 0, hits)
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 1
    assert [b.ref_count for b in bm.blocks] == [2, 2, 1, 0]


def test_nothing_to_publish_before_any_block():
    bm = BlockManager(4, BS)
    seq = make_seq(range(3))
    bm.cache_full_blocks(seq)  # no blocks, nothing computed: nothing happens
    assert bm.cached == {} and seq.block_hashes == []


def test_decode_fills_the_last_block_before_taking_another():
    bm = BlockManager(3, BS)
    seq = make_seq(range(3))
    admit(bm, seq)
    assert decode(bm, seq, 3) and seq.block_table == [0]  # position 3: still block 0
    assert decode(bm, seq, 4) and seq.block_table == [0, 1]  # position 4: a new block
    bm.check_invariants([seq])


def test_allocation_fails_when_full_and_changes_nothing():
    bm = BlockManager(2, BS)
    seq = make_seq(range(8))
    admit(bm, seq)
    assert not decode(bm, seq, 8)
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 0
    bm.check_invariants([seq])


def test_free_releases_every_block():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    seq = make_seq(range(9))
    admit(bm, seq)
    assert bm.num_free_blocks == 1
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants([])


def test_double_free_is_caught():
    bm = BlockManager(2, BS)
    seq = make_seq(range(3))
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="double free"):
        bm.free(seq)


# ---------------------------------------------------------------- prefix caching
def test_hit_shares_blocks_and_counts_references():
    bm = BlockManager(8, BS)
    a = make_seq(range(9))
    assert admit(bm, a) == 0
    b = make_seq(list(range(8)) + [99, 98])
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.check_invariants([b])


def test_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(8, BS)
    admit(bm, make_seq(range(8)))
    assert len(bm.get_computed_blocks(make_seq(range(8)))) == 1  # (8 - 1) // 4
    assert len(bm.get_computed_blocks(make_seq(range(9)))) == 2
    assert len(bm.get_computed_blocks(make_seq(range(4)))) == 0


def test_no_hits_without_prefix_caching_or_with_prompt_logprobs():
    bm = BlockManager(8, BS)
    admit(bm, make_seq(range(9)))
    assert bm.get_computed_blocks(make_seq(range(9), prompt_logprobs=1)) == []
    off = BlockManager(8, BS, enable_prefix_caching=False)
    admit(off, make_seq(range(9)))
    assert off.cached == {} and off.get_computed_blocks(make_seq(range(9))) == []


def test_prompt_logprobs_request_publishes_nothing():
    bm = BlockManager(8, BS)
    admit(bm, make_seq(range(9), prompt_logprobs=0))
    assert bm.cached == {}


def test_hits_stop_at_the_first_miss():
    bm = BlockManager(8, BS)
    admit(bm, make_seq(range(12)))
    other = make_seq([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert len(bm.get_computed_blocks(other)) == 1


def test_only_computed_full_blocks_are_published():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    admit(bm, seq, computed=False)
    seq.num_computed_tokens = 7  # a chunk: block 0 full and computed, block 1 not
    bm.cache_full_blocks(seq)
    assert [b.block_hash is not None for b in bm.blocks[:3]] == [True, False, False]
    bm.check_invariants([seq])
    seq.num_computed_tokens = 10
    bm.cache_full_blocks(seq)
    assert [b.block_hash is not None for b in bm.blocks[:3]] == [True, True, False]
    assert len(bm.cached) == 2
    bm.check_invariants([seq])


def test_publication_chains_serials():
    bm = BlockManager(8, BS)
    seq = make_seq(range(12))
    admit(bm, seq)
    blocks = [bm.blocks[i] for i in seq.block_table]
    assert blocks[0].parent_serial is None
    assert blocks[1].parent_serial == blocks[0].serial and blocks[2].parent_serial == blocks[1].serial
    assert len({b.serial for b in blocks}) == 3
    assert blocks[0].token_ids == (0, 1, 2, 3)


def test_decode_publishes_each_block_as_it_fills():
    bm = BlockManager(8, BS)
    seq = make_seq(range(3))
    admit(bm, seq)
    assert bm.cached == {}
    decode(bm, seq, 3)
    assert len(bm.cached) == 1
    for t in range(4, 8):
        decode(bm, seq, t)
    assert len(bm.cached) == 2
    bm.check_invariants([seq])
    assert admit(bm, make_seq(range(9))) == 8


def test_prefix_computed_twice_links_to_the_published_twin():
    """Two sequences compute the same prefix side by side: the second's blocks stay private,
    and its later blocks chain to the published twin (so they are hits for a third one)."""
    bm = BlockManager(16, BS)
    a, b = make_seq(range(8)), make_seq(list(range(8)) + [50, 51, 52, 53, 54])
    admit(bm, a, computed=False)
    admit(bm, b, computed=False)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    assert len(bm.cached) == 3  # a's two blocks, then b's third chained to a's second
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.check_invariants([a, b])
    c = make_seq(list(range(8)) + [50, 51, 52, 53, 60])
    hits = bm.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [a.block_table[0], a.block_table[1], b.block_table[2]]


def const_hash(parent, tokens):
    return 7 if parent is None else parent + 1


def test_collision_is_never_served():
    bm = BlockManager(8, BS, hash_fn=const_hash)
    admit(bm, make_seq([1, 1, 1, 1, 2]))
    other = make_seq([3, 3, 3, 3, 2])  # same hash, other tokens
    assert bm.get_computed_blocks(other) == []
    admit(bm, other)
    assert len(bm.cached) == 1  # the collision is not published over the first
    bm.check_invariants()


def test_after_a_collision_nothing_later_is_published():
    bm = BlockManager(8, BS, hash_fn=const_hash)
    admit(bm, make_seq([1, 1, 1, 1, 2]))
    seq = make_seq([3, 3, 3, 3, 4, 4, 4, 4, 5])
    admit(bm, seq)
    assert all(bm.blocks[i].block_hash is None for i in seq.block_table)


def test_hit_needs_the_same_parent():
    """Block 1 with equal hash and tokens, but computed after another block 0: not a hit."""

    def tokens_only(parent, tokens):  # ignores the parent: equal blocks collide
        return hash(tuple(tokens))

    bm = BlockManager(8, BS, hash_fn=tokens_only)
    admit(bm, make_seq([1, 1, 1, 1, 2, 2, 2, 2, 0]))
    other = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0])
    admit(bm, make_seq([3, 3, 3, 3, 9]))  # publishes [3,3,3,3] under its own serial
    assert [b.token_ids for b in bm.get_computed_blocks(other)] == [(3, 3, 3, 3)]


# ---------------------------------------------------------------- eviction order
def test_freed_hashed_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BS)
    a, b = make_seq(range(4)), make_seq(range(10, 14))
    admit(bm, a)  # block 0 (hashed once computed: 4 tokens)
    admit(bm, b)  # block 1
    bm.free(a)
    bm.free(b)
    # unhashed blocks 2, 3 come first, then 0 (freed first), then 1
    assert list(bm.free_blocks) == [2, 3, 0, 1]
    c = make_seq(range(20, 31))  # three blocks: 2, 3, then evicts 0
    admit(bm, c, computed=False)
    assert c.block_table == [2, 3, 0] and bm.num_evictions == 1
    assert bm.blocks[0].block_hash is None and bm.blocks[1].block_hash is not None
    assert bm.get_computed_blocks(make_seq(range(5))) == []
    assert len(bm.get_computed_blocks(make_seq(range(10, 15)))) == 1
    bm.check_invariants([c])


def test_free_puts_the_last_block_first_in_eviction_order():
    bm = BlockManager(3, BS)
    seq = make_seq(range(8))
    admit(bm, seq)
    bm.free(seq)
    assert list(bm.free_blocks) == [2, 1, 0]  # block 2 never hashed: head; then 1 before 0


def test_freed_unhashed_blocks_go_to_the_head():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    seq = make_seq(range(8))
    admit(bm, seq)
    bm.free(seq)
    assert list(bm.free_blocks) == [0, 1, 2]


def test_hit_on_a_free_block_revives_it():
    bm = BlockManager(3, BS)
    a = make_seq(range(8))
    admit(bm, a)
    bm.free(a)
    b = make_seq(range(9))
    assert admit(bm, b, computed=False) == 8
    assert b.block_table[:2] == [0, 1] and 0 not in bm.free_blocks and 1 not in bm.free_blocks
    assert bm.num_evictions == 0
    bm.check_invariants([b])


def test_revived_hits_count_against_free_blocks():
    """Two cached blocks sit in the free queue; the request needs them plus two more blocks,
    but only one other block is free: refused, and nothing changes."""
    bm = BlockManager(3, BS)
    a = make_seq(range(8))
    admit(bm, a)
    bm.free(a)
    b = make_seq(range(13))
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.allocate_slots(b, 5, hits)
    assert b.block_table == [] and bm.num_free_blocks == 3 and all(bl.ref_count == 0 for bl in bm.blocks)
    assert bm.allocate_slots(b, 4, hits)
    assert b.block_table == [0, 1, 2]


def test_hit_on_a_used_block_does_not_touch_the_free_queue():
    bm = BlockManager(3, BS)
    a = make_seq(range(5))
    admit(bm, a)
    b = make_seq(range(6))
    assert admit(bm, b, computed=False) == 4
    assert list(bm.free_blocks) == []
    assert bm.blocks[0].ref_count == 2


def test_reset_prefix_cache():
    bm = BlockManager(4, BS)
    seq = make_seq(range(9))
    admit(bm, seq)
    assert not bm.reset_prefix_cache() and len(bm.cached) == 2
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.cached == {} and all(
        b.block_hash is None and b.token_ids is None and b.serial is None and b.parent_serial is None for b in bm.blocks
    )
    assert bm.num_evictions == 2
    assert bm.get_computed_blocks(make_seq(range(9))) == []
    bm.check_invariants([])


# ---------------------------------------------------------------- check_invariants catches
def _state():
    bm = BlockManager(4, BS)
    seq = make_seq(range(9))
    admit(bm, seq)
    bm.check_invariants([seq])
    return bm, seq


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda bm, s: bm.free_blocks.pop(3), "^free \\+ used != total"),
        (lambda bm, s: setattr(bm.blocks[3], "ref_count", 1), "^free \\+ used != total"),
        (
            lambda bm, s: (setattr(bm.blocks[3], "ref_count", 1), setattr(bm.blocks[2], "ref_count", 0)),
            r"Block\(3, ref=1, hash=None\) in free queue",
        ),
        (lambda bm, s: bm.free_blocks.__setitem__(3, bm.blocks[2]), "in free queue"),
        (lambda bm, s: setattr(bm.blocks[0], "ref_count", 2), "ref_count != 1 live tables"),
        (lambda bm, s: s.block_table.append(s.block_table[0]), "repeats a block"),
        (lambda bm, s: setattr(s, "num_computed_tokens", 13), "computed past its blocks"),
        (lambda bm, s: setattr(bm.blocks[0], "token_ids", (9, 9, 9, 9)), "tokens differ"),
        (lambda bm, s: setattr(bm.blocks[0], "token_ids", (0, 1, 2)), "not a full block"),
        (lambda bm, s: setattr(bm.blocks[0], "token_ids", None), "not a full block"),
        (lambda bm, s: setattr(bm.blocks[0], "serial", None), "has no serial"),
        (lambda bm, s: setattr(bm.blocks[0], "block_hash", 12345), "cache entry"),
        (lambda bm, s: bm.cached.clear(), "hashed but not findable"),
        (lambda bm, s: setattr(s, "num_computed_tokens", 7), "published before its K/V was computed"),
    ],
)
def test_check_invariants_catches(corrupt, message):
    bm, seq = _state()
    corrupt(bm, seq)
    with pytest.raises(AssertionError, match=message):
        bm.check_invariants([seq])


def test_check_invariants_messages_are_whole():
    bm, seq = _state()
    bm.free_blocks.pop(3)
    with pytest.raises(AssertionError, match=FIRST_LINE.format(r"free \+ used != total")):
        bm.check_invariants([seq])


def test_check_invariants_without_live_tables_skips_the_ref_count_check():
    bm, seq = _state()
    bm.blocks[0].ref_count = 2
    bm.check_invariants()
    with pytest.raises(AssertionError, match="ref_count != 1"):
        bm.check_invariants([seq])
