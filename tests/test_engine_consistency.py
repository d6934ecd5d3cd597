"""Self-consistency end to end: the engine's mechanisms must not change its tokens (float32, bitwise)."""

from __future__ import annotations

import pytest

from conformance.compare import assert_tokens_equal
from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import cached_llm, engine_args, prompts_for, token_ids

MODEL = "qwen3-gqa4-hd128"
BS = 16


@pytest.fixture(scope="module")
def path():
    return zoo_model(MODEL)


@pytest.fixture(scope="module")
def baseline(path, device):
    return cached_llm(path, **engine_args(device, block_size=BS, seed=0, enable_prefix_caching=False))


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_starved_kv_cache_preempts_and_matches(path, baseline, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (40, 23, 17, 33, 5, 60, 16, 31), seed=1)
    params = _greedy(64)
    want = token_ids(baseline.generate(prompts, params, use_tqdm=False))
    # 9 blocks of 16 = 144 slots; the longest request alone needs ceil(123 / 16) = 8 blocks
    starved = LLM(path, **engine_args(device, block_size=BS, seed=0, num_kvcache_blocks=9, trace=True))
    got = token_ids(starved.generate(prompts, params, use_tqdm=False))
    assert_tokens_equal(want, got, "starved vs ample KV cache")
    stats = starved.stats()
    assert stats["preemptions"] > 0, stats
    events = starved.llm_engine.tracer.events
    assert sum(len(e.preempted) for e in events) == stats["preemptions"]
    assert stats["num_free_kv_blocks"] == 9
    starved.llm_engine.check_invariants()


@pytest.mark.parametrize("budget", [1, 7, BS, BS + 1])
def test_chunked_prefill_budgets_match(path, baseline, budget, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (1, 15, 16, 17, 40), seed=2)
    params = _greedy(12)
    want = token_ids(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(path, **engine_args(device, block_size=BS, seed=0, max_num_batched_tokens=budget, trace=True))
    got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert_tokens_equal(want, got, f"chunked prefill at budget {budget}")
    events = llm.llm_engine.tracer.events
    assert all(e.num_tokens <= budget for e in events)
    if budget < 40:
        assert any(
            s.phase == "prefill" and s.num_new_tokens < s.num_tokens - s.num_computed_before
            for e in events
            for s in e.seqs
        ), "no prompt was actually chunked"


def test_unchunked_prefill_matches(path, baseline, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (3, 40, 17), seed=4)
    want = token_ids(baseline.generate(prompts, _greedy(8), use_tqdm=False))
    llm = LLM(
        path,
        **engine_args(
            device, block_size=BS, seed=0, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64
        ),
    )
    assert_tokens_equal(want, token_ids(llm.generate(prompts, _greedy(8), use_tqdm=False)), "unchunked")


def test_prefix_caching_on_off_and_cached_token_counts(path, baseline, device):
    vocab = ZOO[MODEL].vocab_size
    shared = prompts_for(vocab, (40,), seed=3)[0]
    tails = prompts_for(vocab, (1, 9, 24), seed=6)
    prompts = [shared[:n] + t for n, t in ((32, tails[0]), (37, tails[1]), (16, tails[2]))] + [shared]
    params = _greedy(10)
    want = token_ids(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(path, **engine_args(device, block_size=BS, seed=0, enable_prefix_caching=True))
    first = llm.generate([shared], params, use_tqdm=False)  # cold: computes and publishes 2 full blocks
    assert first[0].num_cached_tokens == 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_tokens_equal(want, token_ids(outs), "prefix cache on vs off")
    # cached = bs * floor(common prefix / bs), capped so the last prompt token is computed
    assert [o.num_cached_tokens for o in outs] == [32, 32, 16, 32]
    # a fully cached prompt whose length is a multiple of bs still computes its last token
    exact = shared[:32]
    llm.generate([exact], params, use_tqdm=False)
    again = llm.generate([exact], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == token_ids(baseline.generate([exact], params, use_tqdm=False))[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == 32 + 32 + 16 + 32 + 16 + 16 + 0
    llm.llm_engine.check_invariants()


def test_batch_of_one_equals_batch_of_many(path, baseline, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (7, 19, 33, 2, 50, 16, 64, 11, 28), seed=8)
    params = _greedy(16)
    many = token_ids(baseline.generate(prompts, params, use_tqdm=False))
    for i in (0, 4, 8):
        alone = token_ids(baseline.generate([prompts[i]], params, use_tqdm=False))[0]
        assert alone == many[i], f"prompt {i} differs alone vs in a batch"


@pytest.mark.parametrize("bs", [1, 8, 32])
def test_block_sizes_match(path, baseline, bs, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (1, 31, 32, 33), seed=9)
    params = _greedy(10)
    want = token_ids(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(path, **engine_args(device, block_size=bs, seed=0, num_kvcache_blocks=max(8, 256 // bs)))
    assert_tokens_equal(want, token_ids(llm.generate(prompts, params, use_tqdm=False)), f"block_size {bs}")


def test_seeded_sampling_reproducible_and_batch_independent(path, baseline, device):
    vocab = ZOO[MODEL].vocab_size
    prompts = prompts_for(vocab, (12, 30, 5, 22), seed=10)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = baseline.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed = baseline.generate(prompts, [others, others, seeded, others], use_tqdm=False)
    batch = baseline.generate([prompts[1], prompts[0], prompts[2]], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = baseline.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    assert len(mixed) == 4
    # a different seed gives a different sample (the seed is really used)
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert baseline.generate([prompts[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_outputs_in_input_order(path, baseline, device):
    prompts = prompts_for(ZOO[MODEL].vocab_size, (60, 2, 30, 1, 45), seed=11)
    lengths = [9, 1, 5, 13, 2]
    outs = baseline.generate(prompts, [_greedy(n) for n in lengths], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert all(o.finished for o in outs)
