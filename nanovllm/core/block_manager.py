"""Paged KV-cache blocks with a prefix cache. Pure Python: no torch.

Vocabulary. A *block* holds the K/V of ``block_size`` consecutive positions of
one or more sequences. A sequence's *block table* lists its blocks in position
order. A *full* block holds ``block_size`` tokens; its *hash* chains the hash of
the block before it with its own tokens (``hash_block_tokens``), so equal hashes
mean equal prefixes, not only equal blocks.

Invariants (``check_invariants`` asserts all of them):

* Every block is either free (``ref_count == 0``, in ``free_blocks``) or used
  (``ref_count > 0``, not in ``free_blocks``); free + used = total.
* ``ref_count`` equals the number of live block tables that hold the block.
* ``cached`` maps a hash to the one block published under it, and that block
  carries the hash and its tokens. A block is published only when it is full and
  its K/V has been computed (``cache_full_blocks`` runs after the forward pass).
* A cache hit compares the stored tokens *and* its parent: a published block
  records the publication serial of the block its K/V were computed after
  (``parent_serial``), and block i is a hit only when that is the serial of hit
  i-1. So a hash collision -- of the block itself or of any block before it --
  never serves K/V computed after other tokens.

Eviction: ``free_blocks`` is kept in eviction order (an OrderedDict: O(1) pop
from the head, O(1) removal from the middle when a cached block is hit again).
Freed blocks that carry a hash go to the tail (least recently used is evicted
first) and stay findable until reused; freed blocks without a hash hold nothing
worth keeping and go to the head.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import xxhash

from nanovllm.core.sequence import Sequence
from nanovllm.core.utils import cdiv

HashFn = Callable[[int | None, Seq[int]], int]


def hash_block_tokens(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chain hash of one full block: H(parent hash, tokens). Stable across processes."""
    h = xxhash.xxh3_64()
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "serial", "parent_serial")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept for hashed blocks, to verify hits
        self.serial: int | None = None  # unique per publication (None while unpublished)
        self.parent_serial: int | None = None  # serial of the block before it when published (None: first)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_fn: HashFn = hash_block_tokens
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.num_evictions = 0
        self._serials = itertools.count()

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(self.hash_fn(hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks that prefixes seq. Changes nothing.

        At most ``(num_tokens - 1) // block_size`` blocks, so at least one token
        is always computed (the model must produce logits for the last one).
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self.update_block_hashes(seq)
        hits: list[Block] = []
        for i in range(self._max_cached_blocks(seq)):
            block = self.cached.get(seq.block_hashes[i])
            if block is None or not self._is_hit(block, seq, i, hits[-1] if hits else None):
                break
            hits.append(block)
        return hits

    def _max_cached_blocks(self, seq: Sequence) -> int:
        """The most blocks a prefix-cache hit may cover: ``(num_tokens - 1) // block_size``,
        so at least one token is computed (the model must produce logits for the last one)."""
        return (seq.num_tokens - 1) // self.block_size

    def _is_hit(self, block: Block, seq: Sequence, i: int, prev: Block | None) -> bool:
        """Whether ``block``, published under seq's i-th hash, holds seq's block i: the same
        tokens, computed after the same K/V (``prev``: hit i - 1). A collision is never served."""
        bs = self.block_size
        return block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]) and block.parent_serial == (
            prev.serial if prev is not None else None
        )

    # -------------------------------------------------------------- mutations
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: Iterable[Block] = ()) -> bool:
        """Give seq blocks for ``num_new_tokens`` more tokens (after the cache hits).

        All or nothing: on False nothing changed. ``computed_blocks`` (from
        get_computed_blocks) are only passed for a sequence holding no blocks.
        """
        if not computed_blocks and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common decode case: the last block still has room
        computed_blocks = list(computed_blocks)
        assert not computed_blocks or not seq.block_table, "cache hits only on admission"
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # hits that sit in the free queue stop being available for allocation
        num_revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_new_blocks > len(self.free_blocks) - num_revived:
            return False
        for block in computed_blocks:
            self._take_hit(seq, block)
        for _ in range(max(num_new_blocks, 0)):
            _, block = self.free_blocks.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def _take_hit(self, seq: Sequence, block: Block) -> None:
        """Append a cache hit to seq's block table: one more reference; a hit on a free block
        leaves the free queue (it is in use now, so it must not be evicted)."""
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
        block.ref_count += 1
        seq.block_table.append(block.block_id)

    def _evict(self, block: Block) -> None:
        del self.cached[block.block_hash]  # type: ignore[arg-type]  # a cached block has its hash
        block.block_hash = None
        block.token_ids = None
        block.serial = block.parent_serial = None
        self.num_evictions += 1

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (last block first, so it is evicted first)."""
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.block_table = []

    def _release(self, block: Block) -> None:
        """Drop one reference to block. A block nobody holds goes back to the free queue: at the
        tail while it carries a hash (findable until evicted, least recently used first), at
        the head otherwise (it holds nothing worth keeping)."""
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of {block}"
        if block.ref_count == 0:
            self.free_blocks[block.block_id] = block
            if block.block_hash is None:
                self.free_blocks.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of seq's full blocks whose K/V is now computed.

        Call only after the forward pass that wrote them. A block whose hash is
        already published stays private to its sequence: when the published one
        holds the same K/V (same tokens, same parent: the prefix computed twice)
        later blocks chain to it; after a hash collision nothing later is published.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full == 0 or self.blocks[seq.block_table[num_full - 1]].block_hash is not None:
            return  # nothing new: every full block before a published one is published or linked
        self.update_block_hashes(seq)
        bs = self.block_size
        table = seq.block_table
        start = num_full
        while start > 0 and self.blocks[table[start - 1]].block_hash is None:
            start -= 1  # blocks before `start` are published already
        parent = self.blocks[table[start - 1]] if start else None  # published block holding the prefix
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            block_hash = seq.block_hashes[i]
            token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent_serial = parent.serial if parent is not None else None
            twin = self.cached.get(block_hash)
            if twin is None:
                block.block_hash = block_hash
                block.token_ids = token_ids
                block.serial = next(self._serials)
                block.parent_serial = parent_serial
                self.cached[block_hash] = block
                parent = block
            elif twin.token_ids == token_ids and twin.parent_serial == parent_serial:
                parent = twin  # the same K/V, published by another sequence
            else:
                return  # a hash collision: no later block of seq can be published safely

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (like vLLM)."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        for block in list(self.cached.values()):
            self._evict(block)
        return True

    # ------------------------------------------------------------- invariants
    def check_invariants(self, live_seqs: Iterable[Sequence] | None = None) -> None:
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(self.free_blocks) == self.num_blocks, "free + used != total"
        for block_id, block in self.free_blocks.items():
            assert block.block_id == block_id and block.ref_count == 0, f"{block} in free queue"
        for block in self.blocks:
            assert block.ref_count >= 0, f"{block} has negative ref_count"
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks), f"{block} free/used mismatch"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache entry {block_hash} -> {block}"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                f"published {block} is not a full block"
            )
            assert block.serial is not None, f"published {block} has no serial"
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} hashed but not findable"
        if live_seqs is None:
            return
        refs = [0] * self.num_blocks
        bs = self.block_size
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} repeats a block"
            assert len(seq.block_table) * bs >= seq.num_computed_tokens, f"{seq} computed past its blocks"
            for i, block_id in enumerate(seq.block_table):
                refs[block_id] += 1
                block = self.blocks[block_id]
                if block.block_hash is not None:
                    assert (i + 1) * bs <= seq.num_computed_tokens, (
                        f"{block} published before its K/V was computed in {seq}"
                    )
                    assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]), (
                        f"{block} tokens differ from {seq}'s block {i}"
                    )
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"{block} ref_count != {refs[block.block_id]} live tables holding it"
            )
