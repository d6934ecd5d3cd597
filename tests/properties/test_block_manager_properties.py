"""Property-based conformance checks of the BlockManager (catalogue items 1-5).

1. a hypothesis state machine: allocate / append / share prefixes / free /
   preempt (free + re-admit) / evict, with invariants after every rule, checked
   against a small model (expected block tables, free count, fake K/V);
2. hash-chain locality, partial blocks never hashed, hashes stable across
   processes with different PYTHONHASHSEED;
3. collision safety under a 4-bit hash: no hit serves K/V of other tokens;
4. cached tokens = bs * floor(common prefix / bs), capped so one token is
   always computed; blocks in use are never evicted;
5. a failed allocation changes nothing.

Items 3 and 4 run the real ``LLMEngine`` over a fake executor
(``tests/properties/harness.py``), async scheduling off and on.

Each property has a negative control: a mutant from ``tests.mutants.core``
under which the property check fails.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from nanovllm.core.block_manager import BlockManager, hash_block_tokens
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams
from tests.mutants.core import MUTANTS
from tests.properties.fake_runner import KV_ROOT, kv_chain, kv_value
from tests.properties.harness import EngineHarness

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64)


def weak_hash(parent_hash, token_ids) -> int:
    """A deliberately weak 4-bit block hash: collisions are everywhere."""
    return hash_block_tokens(parent_hash, token_ids) & 0xF


def make_seq(seq_id: int, tokens) -> Sequence:
    return Sequence(seq_id, f"s{seq_id}", list(tokens), PARAMS)


def snapshot(bm: BlockManager) -> tuple:
    """Everything an allocation may change: ref counts, hashes, free queue order, hash map."""
    return (
        [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks],
        list(bm.free_blocks),
        {h: b.block_id for h, b in bm.cached.items()},
        bm.num_evictions,
    )


def negative_settings() -> settings:
    """For negative controls: stop at the first failure, no shrinking, no example database."""
    return settings(
        settings.default,
        max_examples=max(settings.default.max_examples, 200),
        phases=[Phase.explicit, Phase.generate],
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        print_blob=False,
    )


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


# =========================================================== 1. state machine
class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences move between ``live`` (holding blocks) and ``waiting`` (preempted, holding none).

    A live sequence has ``pending`` tokens allocated but not computed yet; ``compute``
    writes their fake K/V into the slots and publishes full blocks (as
    ``update_after_step`` does after a forward pass). The model keeps each live
    sequence's expected block table and the fake K/V; invariants compare the
    BlockManager with it after every rule.
    """

    live = Bundle("live")
    waiting = Bundle("waiting")
    freed = Bundle("freed")  # sequences that ended: their cached blocks may still be findable

    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(1, 12),
        hash_kind=st.sampled_from(["xxhash", "weak4"]),
        prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size, num_blocks, hash_kind, prefix_caching):
        kwargs = {"hash_fn": weak_hash} if hash_kind == "weak4" else {}
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, **kwargs)
        self.bs = block_size
        self.weak = hash_kind == "weak4"
        self.seqs: dict[int, Sequence] = {}  # live: seq_id -> seq
        self.pending: dict[int, int] = {}  # live: allocated, not yet computed tokens
        self.tables: dict[int, list[int]] = {}  # model: expected block table of each live seq
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.ids = itertools.count()

    # ------------------------------------------------------------- helpers
    def _truth(self, seq: Sequence) -> list[int]:
        return kv_chain(seq.token_ids)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def _check_hits(self, seq: Sequence, hits) -> None:
        bs = self.bs
        cap = (seq.num_tokens - 1) // bs
        assert len(hits) <= cap, f"{len(hits)} hit blocks leave no token of {seq.num_tokens} to compute"
        if not self.bm.enable_prefix_caching:
            assert not hits, "prefix caching is off but get_computed_blocks hit"
        assert len({b.block_id for b in hits}) == len(hits), "a hit block repeats"
        truth = self._truth(seq)
        for i, block in enumerate(hits):
            want = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            assert block.token_ids == want, f"hit {block} holds tokens {block.token_ids}, sequence has {want}"
            for off in range(bs):
                pos = i * bs + off
                slot = block.block_id * bs + off
                assert self.kv[slot] == (pos, truth[pos]), (
                    f"hit {block} serves K/V {self.kv[slot]} at position {pos}, the sequence needs {truth[pos]}"
                )

    def _allocate(self, seq: Sequence, num_new: int, hits=()) -> bool:
        before = snapshot(self.bm)
        table_before = list(seq.block_table)
        computed_before = seq.num_computed_tokens
        hits = list(hits)
        cached = len(hits) * self.bs
        need = self.bm.blocks_needed(seq.num_computed_tokens + cached + num_new) - len(seq.block_table) - len(hits)
        available = self.bm.num_free_blocks - sum(1 for b in hits if b.ref_count == 0)
        ok = self.bm.allocate_slots(seq, num_new, hits)
        note(f"allocate_slots({seq}, {num_new}, {len(hits)} hits) -> {ok}")
        if not ok:
            assert need > available, f"allocation of {need} blocks failed with {available} available"
            assert snapshot(self.bm) == before, "a failed allocation changed the block manager"
            assert seq.block_table == table_before and seq.num_computed_tokens == computed_before, (
                "a failed allocation changed the sequence"
            )
            return False
        assert need <= available, f"allocation of {need} blocks succeeded with {available} available"
        assert seq.block_table[: len(table_before)] == table_before, "block table is not append-only"
        assert seq.block_table[len(table_before) : len(table_before) + len(hits)] == [b.block_id for b in hits], (
            "cache hits are not the first blocks of the table"
        )
        assert len(seq.block_table) == self.bm.blocks_needed(computed_before + cached + num_new), (
            f"{seq} got {len(seq.block_table)} blocks for {computed_before + cached + num_new} tokens"
        )
        self.tables[seq.seq_id] = list(seq.block_table)
        return True

    def _admit(self, seq: Sequence, chunk: int):
        hits = self.bm.get_computed_blocks(seq)
        self._check_hits(seq, hits)
        cached = len(hits) * self.bs
        num_new = 1 + chunk % (seq.num_tokens - cached)
        if not self._allocate(seq, num_new, hits):
            return multiple()
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.seqs[seq.seq_id] = seq
        self.pending[seq.seq_id] = num_new
        return seq

    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        assert seq.block_table == [], "free left a block table"
        del self.seqs[seq.seq_id], self.pending[seq.seq_id], self.tables[seq.seq_id]

    # --------------------------------------------------------------- rules
    @rule(target=live, tokens=tokens_st, chunk=st.integers(0, 20))
    def admit(self, tokens, chunk):
        return self._admit(make_seq(next(self.ids), tokens), chunk)

    @rule(
        target=live,
        parent=live,
        cut=st.integers(0, 16),
        suffix=st.lists(st.integers(0, 2), max_size=5),
        chunk=st.integers(0, 20),
    )
    def share_prefix(self, parent, cut, suffix, chunk):
        """A new sequence that shares a prefix with a live one (a prefix-cache hit, when published)."""
        tokens = parent.token_ids[:cut] + suffix or [0]
        return self._admit(make_seq(next(self.ids), tokens), chunk)

    @rule(
        target=live,
        parent=freed,
        cut=st.integers(0, 16),
        suffix=st.lists(st.integers(0, 2), max_size=5),
        chunk=st.integers(0, 20),
    )
    def share_prefix_of_freed(self, parent, cut, suffix, chunk):
        """A new sequence sharing a prefix with one that ended (hits on free cached blocks)."""
        tokens = parent.token_ids[:cut] + suffix or [0]
        return self._admit(make_seq(next(self.ids), tokens), chunk)

    @rule(target=freed, tokens=tokens_st)
    def run_to_completion(self, tokens):
        """A whole request: admit (with its hits), compute every token, publish, free."""
        seq = make_seq(next(self.ids), tokens)
        if self._admit(seq, seq.num_tokens) is not seq:  # chunk = everything left
            return multiple()
        self.compute(seq)
        self._release(seq)
        return seq

    @rule(seq=live)
    def compute(self, seq):
        """The forward pass: write the pending tokens' K/V, then publish full blocks."""
        if seq.seq_id not in self.seqs:
            return
        n = self.pending[seq.seq_id]
        start = seq.num_computed_tokens
        truth = self._truth(seq)
        for pos in range(start):  # attention reads every earlier position through the block table
            assert self.kv[self._slot(seq, pos)] == (pos, truth[pos]), (
                f"{seq}: K/V of position {pos} was overwritten while in use"
            )
        for pos in range(start, start + n):
            prev = truth[pos - 1] if pos else KV_ROOT
            self.kv[self._slot(seq, pos)] = (pos, kv_value(prev, pos, seq.token_ids[pos]))
        seq.num_computed_tokens += n
        self.pending[seq.seq_id] = 0
        self.bm.cache_full_blocks(seq)

    @rule(seq=live, chunk=st.integers(0, 20), token=st.integers(0, 2))
    def extend(self, seq, chunk, token):
        """Schedule more of seq: the rest of its prompt in chunks, or (decoding) append one token."""
        if seq.seq_id not in self.seqs or self.pending[seq.seq_id]:
            return
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        num_new = 1 + chunk % (seq.num_tokens - seq.num_computed_tokens)
        if self._allocate(seq, num_new):
            self.pending[seq.seq_id] = num_new

    @rule(target=freed, seq=consumes(live))
    def free(self, seq):
        if seq.seq_id not in self.seqs:
            return multiple()
        self._release(seq)
        return seq

    @rule(target=waiting, seq=consumes(live))
    def preempt(self, seq):
        """Recompute preemption: free the blocks, forget the computed tokens, keep the tokens."""
        if seq.seq_id not in self.seqs:
            return multiple()
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        return seq

    @rule(target=live, seq=consumes(waiting), chunk=st.integers(0, 20))
    def readmit(self, seq, chunk):
        assert not seq.block_table, f"preempted {seq} holds blocks"
        return self._admit(seq, chunk)

    @precondition(lambda self: self.bm.num_free_blocks > 0)
    @rule(tokens=st.lists(st.integers(3, 5), min_size=1, max_size=4))
    def evict(self, tokens):
        """Take every free block (evicting the cached ones), then give them back."""
        in_use = {bid: (b.block_hash, b.token_ids) for bid, b in enumerate(self.bm.blocks) if b.ref_count}
        seq = make_seq(next(self.ids), tokens * 50)
        n = self.bm.num_free_blocks
        assert self.bm.allocate_slots(seq, n * self.bs), "could not take every free block"
        assert self.bm.num_free_blocks == 0
        for bid, state in in_use.items():
            b = self.bm.blocks[bid]
            assert (b.block_hash, b.token_ids) == state, f"{b} was in use and got evicted"
        for b in self.bm.cached.values():
            assert b.ref_count > 0, f"{b} is cached and free after every free block was taken"
        for pos in range(n * self.bs):  # the new owner writes its slots
            self.kv[self._slot(seq, pos)] = None
        self.bm.free(seq)

    @precondition(lambda self: self.bm.num_free_blocks == self.bm.num_blocks)
    @rule()
    def reset_prefix_cache(self):
        assert self.bm.reset_prefix_cache()
        assert not self.bm.cached and all(b.block_hash is None for b in self.bm.blocks), (
            "reset_prefix_cache left published blocks"
        )

    # ---------------------------------------------------------- invariants
    @invariant()
    def block_manager_invariants(self):
        self.bm.check_invariants(list(self.seqs.values()))

    @invariant()
    def matches_model(self):
        bm = self.bm
        used: dict[int, int] = {}
        for sid, seq in self.seqs.items():
            assert seq.block_table == self.tables[sid], f"{seq} table changed behind the model's back"
            for bid in seq.block_table:
                used[bid] = used.get(bid, 0) + 1
        assert bm.num_free_blocks == bm.num_blocks - len(used), (
            f"free count {bm.num_free_blocks} != {bm.num_blocks} - {len(used)} used"
        )
        for b in bm.blocks:
            assert b.ref_count == used.get(b.block_id, 0), f"{b} ref_count != {used.get(b.block_id, 0)}"
        for b in bm.cached.values():  # published = full and computed: its K/V are written
            assert b.token_ids is not None and len(b.token_ids) == self.bs
            assert all(self.kv[b.block_id * self.bs + off] is not None for off in range(self.bs)), (
                f"{b} is published but its K/V were never written"
            )

    @invariant()
    def live_kv_intact(self):
        """Blocks in use are never evicted or overwritten: every computed position reads its own K/V."""
        for seq in self.seqs.values():
            truth = self._truth(seq)
            for pos in range(seq.num_computed_tokens):
                assert self.kv[self._slot(seq, pos)] == (pos, truth[pos]), (
                    f"{seq}: K/V of position {pos} lost while in use"
                )


TestBlockManagerMachine = BlockManagerMachine.TestCase


def _machine_without_kv_model():
    """The same machine but relying on BlockManager.check_invariants only (what the engine itself checks)."""

    class Machine(BlockManagerMachine):
        pass

    Machine.matches_model = invariant()(lambda self: None)
    Machine.live_kv_intact = invariant()(lambda self: None)
    return Machine


def narrowed(**fixed) -> type[BlockManagerMachine]:
    """The same machine, rules and invariants, with some setup arguments narrowed to a corner."""
    args = {
        "block_size": st.integers(1, 4),
        "num_blocks": st.integers(1, 12),
        "hash_kind": st.sampled_from(["xxhash", "weak4"]),
        "prefix_caching": st.just(True),
        **fixed,
    }

    class Narrowed(BlockManagerMachine):
        @initialize(**args)
        def setup(self, block_size, num_blocks, hash_kind, prefix_caching):
            BlockManagerMachine.setup(self, block_size, num_blocks, hash_kind, prefix_caching)

    return Narrowed


SMALL = {"num_blocks": st.integers(2, 5), "block_size": st.integers(1, 2), "hash_kind": st.just("xxhash")}
# mutant -> the corner its negative control searches (the full space finds it too, in more examples)
BM_NEGATIVE_CORNERS = {
    "free_no_decref": {},
    "publish_before_compute": {},
    "stale_hash_after_eviction": SMALL,
    "hit_left_in_free_queue": SMALL,
    "failed_alloc_not_atomic": SMALL,
}


@pytest.mark.parametrize("mutant", list(BM_NEGATIVE_CORNERS))
def test_negative_block_manager_machine(mutant):
    with MUTANTS[mutant](), pytest.raises(AssertionError):
        run_state_machine_as_test(narrowed(**BM_NEGATIVE_CORNERS[mutant]), settings=negative_settings())


def test_negative_block_manager_machine_check_invariants_alone():
    """check_invariants by itself (no model) catches the ref-count and publish-order bugs."""
    for mutant in ("free_no_decref", "publish_before_compute"):
        with MUTANTS[mutant](), pytest.raises(AssertionError):
            run_state_machine_as_test(_machine_without_kv_model(), settings=negative_settings())


# ====================================================== 2. hash-chain locality
def block_hashes(tokens, bs, hash_fn=None) -> list[int]:
    bm = BlockManager(1, bs, True, **({} if hash_fn is None else {"hash_fn": hash_fn}))
    seq = make_seq(0, tokens)
    bm.update_block_hashes(seq)
    return seq.block_hashes


def check_hash_locality(tokens, bs, p, new_token) -> None:
    assert tokens[p] != new_token
    changed = list(tokens)
    changed[p] = new_token
    h1, h2 = block_hashes(tokens, bs), block_hashes(changed, bs)
    full = len(tokens) // bs
    assert len(h1) == len(h2) == full, f"{len(h1)} hashes for {len(tokens)} tokens (bs={bs}): partial block hashed"
    for i in range(full):
        if i < p // bs:
            assert h1[i] == h2[i], f"token {p} changed the hash of earlier block {i}"
        else:
            assert h1[i] != h2[i], f"token {p} did not change the hash of block {i} >= {p // bs}"


locality_st = st.integers(1, 6).flatmap(
    lambda bs: st.tuples(st.just(bs), st.lists(st.integers(0, 2**31), min_size=1, max_size=6 * bs)).flatmap(
        lambda t: st.tuples(st.just(t[1]), st.just(t[0]), st.integers(0, len(t[1]) - 1), st.integers(0, 2**31))
    )
)


@given(locality_st)
def test_hash_chain_locality(case):
    tokens, bs, p, new = case
    assume(tokens[p] != new)
    check_hash_locality(tokens, bs, p, new)


def test_negative_hash_locality():
    @negative_settings()
    @given(locality_st)
    def prop(case):
        tokens, bs, p, new = case
        assume(tokens[p] != new)
        check_hash_locality(tokens, bs, p, new)

    with MUTANTS["hash_not_chained"](), pytest.raises(AssertionError, match="did not change the hash"):
        prop()


@given(tokens=st.lists(st.integers(0, 5), max_size=30), bs=st.integers(1, 8), computed=st.integers(0, 30))
def test_partial_blocks_never_hashed_or_published(tokens, bs, computed):
    """Only full blocks get a hash; only full *computed* blocks are published."""
    assume(tokens)
    bm = BlockManager(len(tokens) // bs + 2, bs)
    seq = make_seq(0, tokens)
    computed = min(computed, len(tokens))
    assert bm.allocate_slots(seq, computed)
    seq.num_computed_tokens = computed
    bm.cache_full_blocks(seq)
    bm.update_block_hashes(seq)  # hashes every full block of the known tokens, and nothing more
    assert len(seq.block_hashes) == len(tokens) // bs, "a partial block was hashed"
    published = [b for b in bm.blocks if b.block_hash is not None]
    assert len(published) == computed // bs, f"{len(published)} blocks published, {computed // bs} are full+computed"
    for b in published:
        i = seq.block_table.index(b.block_id)
        assert (i + 1) * bs <= computed and len(b.token_ids) == bs
    bm.check_invariants([seq])


HASH_CASES = [[], [0], [1, 2, 3, 4], list(range(40)), [2**40, 7, 2**62, 0, 1, 2, 3], [5] * 33]
_HASH_SCRIPT = r"""
import json, sys, types
pkg = types.ModuleType("nanovllm"); pkg.__path__ = [sys.argv[1] + "/nanovllm"]
sys.modules["nanovllm"] = pkg  # skip nanovllm/__init__ (it imports torch): only the pure-Python core
sys.path.insert(0, sys.argv[1])
import contextlib
mutant = sys.argv[2]
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
ctx = contextlib.nullcontext()
if mutant:
    from tests.mutants.core import MUTANTS
    ctx = MUTANTS[mutant]()
out = []
with ctx:
    for bs in (1, 3, 4, 16):
        for tokens in json.loads(sys.argv[3]):
            bm = BlockManager(1, bs)
            seq = Sequence(0, "x", tokens, SamplingParams())
            bm.update_block_hashes(seq)
            out.append(seq.block_hashes)
print(json.dumps(out))
"""


def hashes_in_subprocesses(seeds=("0", "12345", "4242"), mutant: str = "") -> list[list[list[int]]]:
    procs = []
    for seed in seeds:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _HASH_SCRIPT, str(REPO), mutant, json.dumps(HASH_CASES)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        results.append(json.loads(stdout))
    return results


def check_hashes_cross_process(mutant: str = "") -> None:
    results = hashes_in_subprocesses(mutant=mutant)
    for r in results[1:]:
        assert r == results[0], "block hashes differ between processes with different PYTHONHASHSEED"
    if not mutant:
        here = []
        for bs in (1, 3, 4, 16):
            for tokens in HASH_CASES:
                here.append(block_hashes(tokens, bs) if tokens else [])
        assert here == results[0], "block hashes differ between this process and a fresh one"


def test_hash_stable_across_processes():
    check_hashes_cross_process()


def test_negative_hash_cross_process():
    with pytest.raises(AssertionError, match="differ between processes"):
        check_hashes_cross_process(mutant="hash_uses_python_hash")


# ======================================================= 3. collision safety
workload_st = st.tuples(
    st.integers(1, 4),  # block size
    st.lists(st.integers(0, 1), min_size=0, max_size=12),  # a shared stem
    st.lists(
        st.tuples(st.integers(0, 12), st.lists(st.integers(0, 1), max_size=8), st.integers(1, 6)),
        min_size=1,
        max_size=8,
    ),  # (cut of stem, suffix, max_tokens)
    st.integers(0, 6),  # extra KV blocks beyond the minimum
    st.integers(1, 4),  # max_num_seqs
    st.booleans(),  # async scheduling
)


def run_workload(case, *, hash_fn=None, strict=True, check=True, ample=False):
    bs, stem, reqs, extra, max_num_seqs, async_scheduling = case
    prompts = [(stem[:cut] + suffix) or [0] for cut, suffix, _ in reqs]
    need = max(-(-(len(p) + m - 1) // bs) for p, (_, _, m) in zip(prompts, reqs))
    num_blocks = 200 if ample else need + extra
    eng = EngineHarness(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8,
        async_scheduling=async_scheduling,
        hash_fn=hash_fn,
        vocab_size=2,
        strict=strict,
        check=check,
    )
    for prompt, (_, _, max_tokens) in zip(prompts, reqs):
        eng.add_request(prompt, max_tokens)
    eng.run()
    return eng


def check_collision_safety(case) -> None:
    """With a 4-bit hash, every hit's tokens and K/V are the sequence's own (strict fake K/V reads)."""
    orig = BlockManager.get_computed_blocks

    def spy(self, seq):
        hits = orig(self, seq)
        bs = self.block_size
        for i, b in enumerate(hits):
            assert b.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]), (
                f"cache hit {b} holds tokens {b.token_ids}, not the sequence's block {i}"
            )
        return hits

    BlockManager.get_computed_blocks = spy
    try:
        eng = run_workload(case, hash_fn=weak_hash)
    finally:
        BlockManager.get_computed_blocks = orig
    for rid in eng.outputs:
        assert eng.outputs[rid] == eng.expected_output(rid), f"{rid}: output differs from the reference"


@given(workload_st)
def test_collision_safety_weak_hash(case):
    check_collision_safety(case)


def test_negative_collision_safety():
    @negative_settings()
    @given(workload_st)
    def prop(case):
        check_collision_safety(case)

    with MUTANTS["hit_skips_token_check"](), pytest.raises(AssertionError):
        prop()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_collision_of_parent_hash_never_serves_wrong_kv(async_scheduling):
    """Regression: a collision at block i-1 must not let block i (same tokens, other prefix) be served.

    Two prompts [a | t] and [b | t] whose first blocks collide under the hash: the
    second sequence's block 0 hits its own computed copy, block 1 must not hit the
    K/V computed after ``a``.
    """
    bs = 2
    colliding = lambda parent, tokens: 0 if parent is None else hash_block_tokens(parent, tokens)  # noqa: E731
    eng = EngineHarness(
        num_blocks=16, block_size=bs, max_num_seqs=1, async_scheduling=async_scheduling, hash_fn=colliding, vocab_size=5
    )
    a, b, t = [1, 1], [2, 2], [3, 3]
    eng.add_request(b + [4], 1)  # publishes block [2 2] under hash 0
    eng.run()
    eng.add_request(a + t + [4], 1)  # block [1 1] collides with it (stays private)
    eng.run()  # ... so [3 3]-after-[1 1] must not be findable as [3 3]-after-[2 2]
    eng.add_request(b + t + [4], 1)  # block 0 hits [2 2]; block 1 must not hit [3 3]-after-[1 1]
    eng.run()  # strict fake K/V: a wrong hit raises KVCacheError
    for rid in eng.outputs:
        assert eng.outputs[rid] == eng.expected_output(rid)


# =========================================== 4. cached tokens, in-use blocks
def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_cached_tokens(bs, prompts, async_scheduling=False) -> None:
    """Requests run one after another with an ample cache: each hits exactly the full blocks it shares."""
    vocab_size = max(3, 1 + max(t for prompt, _ in prompts for t in prompt))
    eng = EngineHarness(
        num_blocks=400,
        block_size=bs,
        max_num_seqs=1,
        max_num_batched_tokens=1000,
        async_scheduling=async_scheduling,
        vocab_size=vocab_size,
    )
    computed: list[list[int]] = []  # token sequences whose K/V were computed (all but the last sampled)
    for prompt, max_tokens in prompts:
        seq = eng.add_request(prompt, max_tokens)
        common = max((common_prefix(prompt, c) for c in computed), default=0)
        expect = bs * (min(common, len(prompt) - 1) // bs)
        hits = eng.block_manager.get_computed_blocks(seq)
        assert len(hits) * bs == expect, (
            f"prompt {prompt}: {len(hits) * bs} cached tokens, expected bs*floor(min({common}, {len(prompt) - 1})/bs)"
            f" = {expect}"
        )
        eng.run()
        assert eng.admissions[seq.request_id] == [expect], f"admitted with {eng.admissions[seq.request_id]} cached"
        assert seq.num_cached_tokens == expect
        computed.append(seq.token_ids[:-1])
        assert eng.outputs[seq.request_id] == eng.expected_output(seq.request_id)
    assert eng.block_manager.num_evictions == 0


cached_st = st.integers(1, 5).flatmap(
    lambda bs: st.tuples(
        st.just(bs),
        st.lists(
            st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=4 * bs + 2), st.integers(1, 2 * bs)),
            min_size=1,
            max_size=6,
        ),
        st.booleans(),
    )
)


@given(cached_st)
def test_cached_tokens_multiple_of_block_size(case):
    check_cached_tokens(*case)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("bs", [1, 2, 4, 16])
def test_fully_cached_prompt_computes_last_token(bs, async_scheduling):
    prompt = list(range(3 * bs))
    check_cached_tokens(bs, [(prompt, 2), (prompt, 2), (prompt[:bs], 1), (prompt + [0], 1)], async_scheduling)


def test_negative_cached_tokens():
    @negative_settings()
    @given(cached_st)
    def prop(case):
        check_cached_tokens(*case)

    with MUTANTS["full_hit_skips_last_token"](), pytest.raises(AssertionError):
        prop()


@given(workload_st)
def test_blocks_in_use_never_evicted(case):
    """A starved cache with sharing: every K/V read of every step is the sequence's own (strict)."""
    eng = run_workload(case)
    for rid in eng.outputs:
        assert eng.outputs[rid] == eng.expected_output(rid)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# ========================================================= 5. failed allocation
failed_alloc_st = st.tuples(
    st.integers(1, 4),  # block size
    st.integers(2, 10),  # num blocks
    st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=12), st.booleans()), max_size=6),
    st.lists(st.integers(0, 1), min_size=1, max_size=16),  # the new sequence
    st.integers(0, 3),  # tokens beyond the limit
)


def check_failed_allocation(case) -> None:
    """Allocation succeeds iff the blocks are there; a failed one changes nothing."""
    bs, num_blocks, history, tokens, over = case
    bm = BlockManager(num_blocks, bs)
    live = []
    for i, (toks, keep) in enumerate(history):
        seq = make_seq(i, toks)
        hits = bm.get_computed_blocks(seq)
        if not bm.allocate_slots(seq, seq.num_tokens - len(hits) * bs, hits):
            continue
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        (live.append(seq) if keep else bm.free(seq))
    seq = make_seq(99, tokens)
    hits = bm.get_computed_blocks(seq)
    revived = sum(1 for b in hits if b.ref_count == 0)
    available = bm.num_free_blocks - revived
    fits = available * bs  # new tokens that fit in the available blocks (hits are whole blocks)
    before, table = snapshot(bm), list(seq.block_table)
    assert not bm.allocate_slots(seq, fits + 1 + over * bs, hits), "allocated beyond the free blocks"
    assert snapshot(bm) == before, "a failed allocation changed ref counts, free queue or hash map"
    assert seq.block_table == table and seq.num_computed_tokens == 0, "a failed allocation changed the sequence"
    bm.check_invariants(live)
    if fits >= 1:
        assert bm.allocate_slots(seq, fits, hits), f"allocation of {fits} tokens failed with {available} blocks"
        seq.num_computed_tokens = len(hits) * bs
        bm.check_invariants(live + [seq])


@given(failed_alloc_st)
def test_failed_allocation_changes_nothing(case):
    check_failed_allocation(case)


def test_negative_failed_allocation():
    @negative_settings()
    @given(failed_alloc_st)
    def prop(case):
        check_failed_allocation(case)

    with MUTANTS["failed_alloc_not_atomic"](), pytest.raises(AssertionError, match="failed allocation changed"):
        prop()
