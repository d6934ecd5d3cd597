"""The prefix cache under a tight cache over time, and when two sequences compute one prefix in a step.

Tight caches (which block a later, unrelated request evicts; what stays hittable):

* on the real engine, expectations from the LRU principle written out here: a finished
  request's blocks are released last block first, so a later request that needs k more blocks
  than the empty ones evicts that request's *last* k full blocks, and the prompt then hits the
  rest; a block hit again by another request becomes recently used and outlives older ones;
* on random workloads (the real engine loop over the fake executor, no torch), every admission's hit, every eviction and the
  free blocks after every step equal the policy model's (tests/properties/policy_model.py).

Same step (the second of two sequences computing the same block finds the first's published
block): its chain continues from the published block, so everything either computed stays
hittable (on the real engine, with the trace showing the two in one step); and with a 4-bit
block hash (collisions everywhere) no hit ever serves K/V computed after other tokens, with
requests admitted together (strict fake K/V reads).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.zoo import ZOO, zoo_model
from nanovllm.core.block_manager import hash_block_tokens
from nanovllm.core.utils import cdiv
from tests.conftest import prompts_for
from tests.properties.harness import EngineHarness
from tests.properties.policy_check import Req, run_against_model

MODEL = "llama-mha-hd64"
BS = 4
NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def llm():
    from nanovllm import LLM

    engine = LLM(zoo_model(MODEL), seed=0, block_size=BS, num_kvcache_blocks=NUM_BLOCKS, trace=True)
    yield engine
    engine.close()


def _run(llm, prompt: list[int], max_tokens: int = 1):
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _fresh(llm) -> None:
    assert llm.reset_prefix_cache(), "no request may hold blocks between checks"


def _prompts(seed: int) -> list[list[int]]:
    """Two prompts of 4 blocks + 1 token and a long one to cut unrelated requests from."""
    return prompts_for(ZOO[MODEL].vocab_size, (4 * BS + 1, 4 * BS + 1, 4 * NUM_BLOCKS * BS), seed=seed)


# ---------------------------------------------------------------- tight caches, real engine
@pytest.mark.parametrize("need_b", range(NUM_BLOCKS - 4, NUM_BLOCKS + 1))
def test_unrelated_request_evicts_the_tail_of_the_least_recent_prefix(llm, need_b):
    """A (4 full blocks + 1 token, one output token) computes and publishes 4 blocks and leaves
    NUM_BLOCKS - 4 empty ones free. An unrelated B that needs ``need_b`` blocks evicts
    max(0, need_b - (NUM_BLOCKS - 4)) cached blocks, A's last ones first; A's prompt then hits
    the blocks that are left, from the head."""
    _fresh(llm)
    a, _, b = _prompts(seed=need_b)
    assert _run(llm, a).num_cached_tokens == 0
    b_out = _run(llm, b[: need_b * BS])  # need_b blocks for its need_b * BS prompt tokens
    assert b_out.num_cached_tokens == 0
    evicted = max(0, need_b - (NUM_BLOCKS - 4))
    again = _run(llm, a)
    assert again.num_cached_tokens == (4 - evicted) * BS, (
        f"after B took {need_b} blocks ({evicted} evictions), A hits {again.num_cached_tokens} tokens, "
        f"expected its first {4 - evicted} blocks"
    )
    assert llm.stats()["num_free_kv_blocks"] == NUM_BLOCKS


def test_a_hit_makes_blocks_recently_used(llm):
    """A publishes blocks A0..A3 (released A3, A2, A1, A0: A3 is the least recent). C shares
    A0 A1, hits them and adds its own C2 C3; released after A's, they are all more recent than
    A2 A3. An unrelated B that must evict 4 blocks takes A3 A2 and then C's blocks (C3 first):
    A0 A1 stay, so A's prompt hits exactly 2 blocks and C's prompt exactly 2 (not 4)."""
    _fresh(llm)
    a, c_tail, b = _prompts(seed=100)
    c = a[: 2 * BS] + c_tail[: 2 * BS + 1]
    _run(llm, a)
    assert _run(llm, c).num_cached_tokens == 2 * BS
    # cached now: A's 4 blocks and C's 2 own full ones; the other blocks are empty
    empty = NUM_BLOCKS - 4 - 2
    _run(llm, b[: (empty + 4) * BS])  # needs `empty` + 4 blocks: evicts 4 cached ones
    assert _run(llm, a).num_cached_tokens == 2 * BS, "A0 A1 (hit by C, recently used) must survive"
    _fresh(llm)
    _run(llm, a)
    _run(llm, c)
    _run(llm, b[: (empty + 4) * BS])
    assert _run(llm, c).num_cached_tokens == 2 * BS, "C2 C3 were released before A0 A1: evicted first"


def test_same_step_prefix_chain_continues():
    """A and B share two blocks and differ after; sent together, they are admitted in one step
    with no hit and both compute the shared blocks: one publishes them, the other links to its
    twin. Everything either computed stays hittable: A's and B's own continuations, and a third
    request identical to A in the same step."""
    from nanovllm import LLM

    llm = LLM(zoo_model(MODEL), seed=0, block_size=BS, num_kvcache_blocks=4 * NUM_BLOCKS, trace=True)
    x, y, z = _prompts(seed=7)
    a = x
    b = x[: 2 * BS] + y[: 2 * BS + 1]
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    start = len(llm.llm_engine.tracer.events)
    outs = llm.generate([{"prompt_token_ids": p} for p in (a, b, a)], params, use_tqdm=False)
    first = llm.llm_engine.tracer.events[start]
    assert [(s.num_computed_before, s.num_new_tokens) for s in first.seqs] == [(0, len(a)), (0, len(b)), (0, len(a))], (
        "A, B and A again must be prefilled together in the first step"
    )
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    for prompt, out in ((a, outs[0]), (b, outs[1])):
        computed = prompt + out.outputs[0].token_ids[:-1]  # the last token's K/V is never computed
        probe = computed + z[:3]
        got = _run(llm, probe).num_cached_tokens
        assert got == len(computed) // BS * BS, (
            f"a request extending a same-step sequence's {len(computed)} computed tokens hits {got}"
        )
    assert llm.stats()["num_free_kv_blocks"] == 4 * NUM_BLOCKS
    llm.close()


# ------------------------------------------------------------- random workloads, the engine over the fake executor
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1], [1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2], [2, 0, 0, 2, 0, 0, 2, 0]]
reuse_prompt_st = st.tuples(st.sampled_from(STEMS), st.integers(1, 14), st.lists(st.integers(0, 2), max_size=2)).map(
    lambda t: tuple(t[0][: t[1]] + t[2])
)


@st.composite
def pressure_case(draw):
    """Requests mostly one at a time (they see each other's blocks over time), sometimes several
    together (same-step twins), in a cache only a little larger than one request."""
    bs = draw(st.integers(1, 4))
    max_model_len = 20
    one = cdiv(max_model_len - 1, bs)
    cfg = {
        "block_size": bs,
        "num_blocks": draw(st.integers(one, one + 4)),
        "max_num_seqs": draw(st.sampled_from([1, 1, 2, 3])),
        "max_num_batched_tokens": draw(st.sampled_from([3, 7, 64])),
        "max_model_len": max_model_len,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    batches = draw(
        st.lists(
            st.tuples(
                st.lists(st.builds(Req, reuse_prompt_st, st.integers(1, 6)), min_size=1, max_size=3),
                st.sampled_from([0, 2, 100]),
            ),
            min_size=2,
            max_size=7,
        )
    )
    return cfg, batches


@settings(max_examples=250, deadline=None)
@given(pressure_case())
def test_tight_cache_hits_and_evictions_follow_policy_model(case):
    cfg, batches = case
    run_against_model(cfg, batches)


def weak_hash(parent_hash, token_ids) -> int:
    """A 4-bit block hash: collisions everywhere."""
    return hash_block_tokens(parent_hash, token_ids) & 0xF


same_step_case = st.tuples(
    st.integers(1, 3),  # block size
    st.lists(
        st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=9), min_size=2, max_size=4), min_size=1, max_size=4
    ),  # batches of prompts sent together
    st.integers(1, 6),  # max_tokens
)


def check_same_step_collision_safety(case) -> None:
    bs, batches, max_tokens = case
    eng = EngineHarness(
        num_blocks=64,
        block_size=bs,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        hash_fn=weak_hash,
        vocab_size=2,
        strict=True,
    )
    for batch in batches:  # each batch is admitted in one step: its sequences compute shared blocks together
        for prompt in batch:
            eng.add_request(prompt, max_tokens)
        eng.run()
    for rid, out in eng.outputs.items():
        assert out == eng.expected_output(rid), f"{rid}: output differs from the reference"


@settings(max_examples=300, deadline=None)
@given(same_step_case)
def test_same_step_twins_collision_safe_under_weak_hash(case):
    """Strict fake K/V: a hit whose K/V was computed after other tokens raises KVCacheError."""
    check_same_step_collision_safety(case)


def test_same_step_collision_regression():
    """Fixed case: blocks [0,0] and [1,1] collide as block 0 (forced hash). In one step X=[0,0,2,2,4]
    publishes [0,0] and [2,2]-after-[0,0]; Y=[1,1,2,2,4] finds its block 0 taken by other tokens,
    so it publishes nothing. Z=[1,1,2,2,3] must then hit nothing (strict fake K/V reads)."""

    def colliding(parent, tokens):
        return 0 if parent is None else hash_block_tokens(parent, tokens)

    eng = EngineHarness(num_blocks=32, block_size=2, max_num_seqs=4, hash_fn=colliding, vocab_size=5, strict=True)
    eng.add_request([0, 0, 2, 2, 4], 1)
    eng.add_request([1, 1, 2, 2, 4], 1)
    eng.run()
    assert len(eng.history) == 1, "X and Y must run in one step"
    eng.add_request([1, 1, 2, 2, 3], 1)
    eng.run()
    assert eng.admissions["r2"] == [0], "Z must not be served blocks computed after other tokens"
    for rid, out in eng.outputs.items():
        assert out == eng.expected_output(rid)
