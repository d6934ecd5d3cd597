"""Named bugs in the block manager, scheduler and model input, switched on by monkeypatching.

``MUTANTS[name]()`` is a context manager: inside it the bug is live in this
process (the class or module attribute is replaced), on exit the original is
restored. Each one replaces or wraps one small named function of the core (a seam:
``BlockManager._release``, ``_is_hit``, ``_max_cached_blocks``, ``_take_hit``,
``Scheduler._admission_chunk``, ``_preemption_victim``, ``_preempt``, ...) in a few
lines, and copies none of the code it mutates, so it cannot drift from it. Nothing here touches shipped code paths on disk. The conformance
mutant runner (``tests/mutants/runner.py``) imports this registry; each
property test in ``tests/properties/test_*_properties.py`` has a negative control
proving that at least one property catches each mutant (see ``NEGATIVE_CONTROLS``).

Importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager

from nanovllm.core import block_manager as bm_mod
from nanovllm.core import model_input as mi_mod
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler


def check_signature(old: object, new: object, where: str) -> None:
    """A replacement must take every call the function it replaces takes: all of its parameters
    by position, and by name where the original allows it. Otherwise the mutant would only make
    its callers raise TypeError, and a test failing on that crash would count it as caught (a
    wrapper of five parameters around a function called with seven was, until this check)."""
    if not (inspect.isfunction(old) or inspect.ismethod(old)) or isinstance(new, type) or not callable(new):
        return
    try:
        so, sn = inspect.signature(old), inspect.signature(new)
    except (TypeError, ValueError):
        return
    P = inspect.Parameter
    params = list(so.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword_only = {p.name: None for p in params if p.kind is P.KEYWORD_ONLY}
    by_name = {p.name: None for p in positional if p.kind is P.POSITIONAL_OR_KEYWORD}
    only_positional = [None for p in positional if p.kind is P.POSITIONAL_ONLY]
    for args, kwargs in (([None] * len(positional), keyword_only), (only_positional, {**by_name, **keyword_only})):
        try:
            sn.bind(*args, **kwargs)
        except TypeError as e:
            raise AssertionError(
                f"mutant replacement of {where} does not take the calls {old.__qualname__}{so} takes: "  # type: ignore[union-attr]
                f"its signature is {sn} ({e})"
            ) from None


@contextlib.contextmanager
def _patched(*patches: tuple[object, str, object]) -> Iterator[None]:
    saved = [
        (obj, name, obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)) for obj, name, _ in patches
    ]
    for (obj, name, new), (_, _, old) in zip(patches, saved):
        check_signature(old, new, f"{getattr(obj, '__name__', obj)}.{name}")
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def _edited(owner: object, name: str, *edits: tuple[str, str]):
    """A copy of the function ``owner.name`` (a module function or a method) whose source has each
    ``(old, new)`` edit applied; ``old`` must occur exactly once, so a mutant that no longer fits
    the code fails loudly instead of silently testing nothing. The copy reads the live globals of
    the function's module."""
    func = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(func))
    for old, new in edits:
        if src.count(old) != 1:
            raise AssertionError(f"mutant edit of {func.__qualname__}: {old!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    namespace: dict = {}
    exec(
        compile(src, f"<mutant of {func.__module__}.{func.__qualname__}>", "exec"),
        sys.modules[func.__module__].__dict__,
        namespace,
    )
    return namespace[func.__name__]


def _edit(owner: object, name: str, *edits: tuple[str, str]) -> ContextManager:
    """Patch ``owner.name`` with its edited copy (see ``_edited``)."""
    return _patched((owner, name, _edited(owner, name, *edits)))


# ------------------------------------------------------------ block manager
def free_no_decref() -> ContextManager:
    """BlockManager.free forgets to decrement ref counts: freed blocks never come back."""
    return _patched((BlockManager, "_release", lambda self, block: None))


def publish_before_compute() -> ContextManager:
    """cache_full_blocks publishes every full block of *tokens*, computed or not."""
    orig = BlockManager.cache_full_blocks

    def cache_full_blocks(self, seq):
        saved = seq.num_computed_tokens
        seq.num_computed_tokens = min(len(seq.token_ids), len(seq.block_table) * self.block_size)
        try:
            orig(self, seq)
        finally:
            seq.num_computed_tokens = saved

    return _patched((BlockManager, "cache_full_blocks", cache_full_blocks))


def hit_skips_token_check() -> ContextManager:
    """get_computed_blocks trusts the hash: no token comparison on a hit (unsafe with collisions)."""
    return _patched((BlockManager, "_is_hit", lambda self, block, seq, i, prev: True))


def full_hit_skips_last_token() -> ContextManager:
    """A fully cached prompt is served whole: no token left to compute (no logits)."""
    return _patched((BlockManager, "_max_cached_blocks", lambda self, seq: seq.num_tokens // self.block_size))


def stale_hash_after_eviction() -> ContextManager:
    """Reusing a cached free block keeps its old hash entry: the old prefix hits new K/V."""

    def _evict(self, block):
        self.num_evictions += 1

    return _patched((BlockManager, "_evict", _evict))


def hit_left_in_free_queue() -> ContextManager:
    """A cache hit on a free block does not take it off the free queue: a block in use can be evicted."""

    def _take_hit(self, seq, block):
        block.ref_count += 1
        seq.block_table.append(block.block_id)

    return _patched((BlockManager, "_take_hit", _take_hit))


def failed_alloc_not_atomic() -> ContextManager:
    """allocate_slots takes its cache hits before checking capacity: a failure leaves them taken."""
    orig = BlockManager.allocate_slots

    def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
        hits = list(computed_blocks)
        if orig(self, seq, num_new_tokens, hits):
            return True
        for block in hits:  # the bug: hits taken although the allocation fails
            self._take_hit(seq, block)
        return False

    return _patched((BlockManager, "allocate_slots", allocate_slots))


def _unchained_hash(parent_hash, token_ids):
    return bm_mod.xxhash.xxh3_64_intdigest(bm_mod.array("q", token_ids).tobytes())


def _python_hash(parent_hash, token_ids):
    return hash((parent_hash, ",".join(map(str, token_ids)))) & ((1 << 64) - 1)


def _hash_fn_patch(fn) -> ContextManager:
    defaults = list(BlockManager.__init__.__defaults__)
    defaults[-1] = fn
    return _patched((bm_mod, "hash_block_tokens", fn), (BlockManager.__init__, "__defaults__", tuple(defaults)))


def hash_not_chained() -> ContextManager:
    """The block hash ignores the parent hash: equal blocks after different prefixes collide."""
    return _hash_fn_patch(_unchained_hash)


def hash_uses_python_hash() -> ContextManager:
    """The block hash uses Python's hash() of a str: it changes with PYTHONHASHSEED."""
    return _hash_fn_patch(_python_hash)


# ---------------------------------------------------------------- scheduler
def budget_off_by_one() -> ContextManager:
    """schedule() lets one token more than max_num_batched_tokens into a step."""
    orig = Scheduler.schedule

    def schedule(self):
        self.max_num_batched_tokens += 1
        try:
            return orig(self)
        finally:
            self.max_num_batched_tokens -= 1

    return _patched((Scheduler, "schedule", schedule))


def max_num_seqs_off_by_one() -> ContextManager:
    """Admission allows max_num_seqs + 1 running sequences."""
    orig = Scheduler.schedule

    def schedule(self):
        self.max_num_seqs += 1
        try:
            return orig(self)
        finally:
            self.max_num_seqs -= 1

    return _patched((Scheduler, "schedule", schedule))


def chunk_boundary_off_by_one() -> ContextManager:
    """After a prefill chunk cut by the budget, the next chunk starts one position too late."""
    orig = Scheduler.update_after_step

    def update_after_step(self, out):
        orig(self, out)
        for seq in out.seqs:
            if seq.num_computed_tokens < seq.num_prompt_tokens - 1:
                seq.num_computed_tokens += 1

    return _patched((Scheduler, "update_after_step", update_after_step))


def preempt_keeps_block_table() -> ContextManager:
    """A preempted sequence's blocks are freed but it keeps (and later reuses) its block table."""
    orig = Scheduler._preempt

    def _preempt(self, seq):
        table = list(seq.block_table)
        orig(self, seq)
        seq.block_table = table

    return _patched((Scheduler, "_preempt", _preempt))


def preempt_oldest() -> ContextManager:
    """Preemption picks the *oldest* running sequence, which may already be scheduled this step."""
    return _patched((Scheduler, "_preemption_victim", lambda self: self.running.pop(0)))


def chunked_off_recompute_stuck() -> ContextManager:
    """Without chunked prefill, a preempted sequence that outgrew the budget is never re-admitted.

    The scheduler as it was before the fix: ``remaining > budget`` always blocks
    admission, so the request waits forever (an empty step with requests pending).
    """
    orig = Scheduler._admission_chunk

    def _admission_chunk(self, num_remaining, budget):
        stuck = not self.enable_chunked_prefill and num_remaining > budget  # the bug: no recompute exception
        return 0 if stuck else orig(self, num_remaining, budget)

    return _patched((Scheduler, "_admission_chunk", _admission_chunk))


# -------------------------------------------------------------- model input
def position_after_preemption() -> ContextManager:
    """ModelInput positions of a re-admitted (preempted) sequence are one too high (RoPE position wrong)."""
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi, plan = orig(out, block_size, finished_seq_ids)
        for j, seq in enumerate(out.seqs):
            if seq.num_preemptions:
                lo, hi = mi.query_start_loc[j], mi.query_start_loc[j + 1]
                mi.positions[lo:hi] = [p + 1 for p in mi.positions[lo:hi]]
        return mi, plan

    patches = [(mi_mod, "build_model_input", build_model_input)]
    engine_mod = sys.modules.get("nanovllm.engine.engine")  # the real engine binds the name at import
    if engine_mod is not None:
        patches.append((engine_mod, "build_model_input", build_model_input))
    return _patched(*patches)


# ------------------------------------------- tight caches over time (eviction order, what stays)
def free_head_block_first() -> ContextManager:
    """free() releases a table first block first: a prefix's head is evicted before its tail,
    so the whole chain stops being hittable while its deeper blocks still take cache room."""
    return _edit(
        BlockManager, "free", ("for block_id in reversed(seq.block_table):", "for block_id in seq.block_table:")
    )


def freed_cached_block_to_head() -> ContextManager:
    """Freed blocks that carry a hash go to the head of the free queue (most recently used is
    evicted first) and empty ones to the tail."""
    return _edit(BlockManager, "_release", ("if block.block_hash is None:", "if block.block_hash is not None:"))


def evict_newest_first() -> ContextManager:
    """Allocation takes free blocks from the tail of the queue: the most recently released cached
    block is evicted first, even while empty blocks are free."""
    return _edit(
        BlockManager, "allocate_slots", ("self.free_blocks.popitem(last=False)", "self.free_blocks.popitem(last=True)")
    )


def hits_only_prompt_blocks() -> ContextManager:
    """Cache hits are looked up over the prompt only: a preempted request, re-admitted with its
    generated tokens, does not find the blocks of those tokens it published before."""
    return _edit(
        BlockManager,
        "_max_cached_blocks",
        ("(seq.num_tokens - 1) // self.block_size", "(seq.num_prompt_tokens - 1) // self.block_size"),
    )


def generated_blocks_never_cached() -> ContextManager:
    """Only prompt blocks are published: blocks full of generated tokens are never cached."""
    return _edit(
        BlockManager,
        "cache_full_blocks",
        (
            "num_full = seq.num_computed_tokens // self.block_size",
            "num_full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size",
        ),
    )


def evictions_not_counted() -> ContextManager:
    """Reusing a cached block forgets its hash but does not count the eviction."""
    return _edit(BlockManager, "_evict", ("self.num_evictions += 1", "pass"))


# ------------------------------------- same step: two sequences compute the same prefix block
def twin_block_stops_chain() -> ContextManager:
    """A block already published by another sequence of the same step is taken for a collision:
    nothing later of this sequence is published, so its own continuation is never hittable."""
    return _edit(
        BlockManager,
        "cache_full_blocks",
        ("elif twin.token_ids == token_ids and twin.parent_serial == parent_serial:", "elif False:"),
    )


def twin_block_chains_from_own_copy() -> ContextManager:
    """After a twin, the chain continues from the sequence's own private copy (which has no
    serial) instead of the published twin: later blocks get a parent no hit can ever match."""
    return _edit(BlockManager, "cache_full_blocks", ("parent = twin  # the same K/V", "parent = block  # the same K/V"))


def twin_check_skips_parent() -> ContextManager:
    """A twin is trusted on its tokens alone: under a hash collision of the parent chain, later
    blocks chain to K/V computed after other tokens."""
    return _edit(
        BlockManager,
        "cache_full_blocks",
        (
            "elif twin.token_ids == token_ids and twin.parent_serial == parent_serial:",
            "elif twin.token_ids == token_ids:",
        ),
    )


# ------------------------------------------------------------- queue order and accounting
def preempted_to_queue_back() -> ContextManager:
    """A preempted request goes to the back of the waiting queue: later arrivals overtake it."""
    return _edit(Scheduler, "_preempt", ("self.waiting.appendleft(seq)", "self.waiting.append(seq)"))


def admit_in_preempting_step() -> ContextManager:
    """A step that preempted still admits waiting requests (which may be the victim itself)."""
    return _edit(Scheduler, "schedule", ("while not out.preempted and self.waiting", "while self.waiting"))


def cache_stats_first_admission_only() -> ContextManager:
    """The prefix-cache counters count a request's first admission only, not its re-admissions."""
    return _edit(
        Scheduler,
        "schedule",
        (
            "seq.num_cached_tokens = num_cached\n        self.num_cache_hit_tokens += num_cached\n"
            "        self.num_cache_query_tokens += seq.num_tokens\n",
            "seq.num_cached_tokens = num_cached\n            self.num_cache_hit_tokens += num_cached\n"
            "            self.num_cache_query_tokens += seq.num_tokens\n",
        ),
    )


def num_cached_tokens_every_admission() -> ContextManager:
    """num_cached_tokens is overwritten at every admission: after a preemption it reports the hit
    of the re-admission (often its own blocks), not of its first admission."""
    return _edit(Scheduler, "schedule", ("if seq.num_cached_tokens < 0:", "if True:"))


def preemptions_not_per_request() -> ContextManager:
    """A preemption is counted engine-wide but not on the request (metrics num_preemptions 0)."""
    return _edit(Scheduler, "_preempt", ("seq.num_preemptions += 1", "pass"))


MUTANTS: dict[str, Callable[[], ContextManager]] = {
    f.__name__: f
    for f in (
        free_no_decref,
        publish_before_compute,
        hit_skips_token_check,
        full_hit_skips_last_token,
        stale_hash_after_eviction,
        hit_left_in_free_queue,
        failed_alloc_not_atomic,
        hash_not_chained,
        hash_uses_python_hash,
        budget_off_by_one,
        max_num_seqs_off_by_one,
        chunk_boundary_off_by_one,
        preempt_keeps_block_table,
        preempt_oldest,
        chunked_off_recompute_stuck,
        position_after_preemption,
        free_head_block_first,
        freed_cached_block_to_head,
        evict_newest_first,
        hits_only_prompt_blocks,
        generated_blocks_never_cached,
        evictions_not_counted,
        twin_block_stops_chain,
        twin_block_chains_from_own_copy,
        twin_check_skips_parent,
        preempted_to_queue_back,
        admit_in_preempting_step,
        cache_stats_first_admission_only,
        num_cached_tokens_every_admission,
        preemptions_not_per_request,
    )
}

# the negative-control tests (under tests/properties/) that prove each mutant is caught; under the quick
# profile the positive property tests of both files catch every mutant too (see the module docstring)
NEGATIVE_CONTROLS: dict[str, list[str]] = {
    "free_no_decref": [
        "test_block_manager_properties.py::test_negative_block_manager_machine[free_no_decref]",
        "test_scheduler_properties.py::test_negative_scheduler_machine[free_no_decref]",
    ],
    "publish_before_compute": [
        "test_block_manager_properties.py::test_negative_block_manager_machine[publish_before_compute]"
    ],
    "hit_skips_token_check": ["test_block_manager_properties.py::test_negative_collision_safety"],
    "full_hit_skips_last_token": ["test_block_manager_properties.py::test_negative_cached_tokens"],
    "stale_hash_after_eviction": [
        "test_block_manager_properties.py::test_negative_block_manager_machine[stale_hash_after_eviction]",
        "test_scheduler_properties.py::test_negative_preemption_exactness[stale_hash_after_eviction]",
    ],
    "hit_left_in_free_queue": [
        "test_block_manager_properties.py::test_negative_block_manager_machine[hit_left_in_free_queue]"
    ],
    "failed_alloc_not_atomic": ["test_block_manager_properties.py::test_negative_failed_allocation"],
    "hash_not_chained": ["test_block_manager_properties.py::test_negative_hash_locality"],
    "hash_uses_python_hash": ["test_block_manager_properties.py::test_negative_hash_cross_process"],
    "budget_off_by_one": ["test_scheduler_properties.py::test_negative_scheduler_machine[budget_off_by_one]"],
    "max_num_seqs_off_by_one": [
        "test_scheduler_properties.py::test_negative_scheduler_machine[max_num_seqs_off_by_one]"
    ],
    "chunk_boundary_off_by_one": ["test_scheduler_properties.py::test_negative_chunk_coverage"],
    "preempt_keeps_block_table": [
        "test_scheduler_properties.py::test_negative_scheduler_machine[preempt_keeps_block_table]"
    ],
    "preempt_oldest": ["test_scheduler_properties.py::test_negative_scheduler_machine[preempt_oldest]"],
    "chunked_off_recompute_stuck": [
        "test_scheduler_properties.py::test_negative_scheduler_machine[chunked_off_recompute_stuck]",
        "test_scheduler_properties.py::test_negative_chunked_prefill_off_recompute",
    ],
    "position_after_preemption": [
        "test_scheduler_properties.py::test_negative_preemption_exactness[position_after_preemption]"
    ],
}
