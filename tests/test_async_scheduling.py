"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read back)
gives exactly the tokens, logprobs and finish reasons of synchronous scheduling.

On a CPU the device work is synchronous, so this checks the bookkeeping only:
placeholder tokens, device-side input filling, early length finishes, stops
discovered while the next step is in flight, preemption, aborts, prefix caching.
The GPU run of the same comparison (with CUDA graphs) is in tests/gpu.
"""

from __future__ import annotations

import random

import pytest

import nanovllm.engine.engine as engine_module
from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import engine_args

MODEL = "qwen3-gqa2-hd64-tied"
VOCAB = ZOO[MODEL].vocab_size


def _workload(n=24, seed=0, stop_every=None):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    stop = list(range(0, VOCAB, stop_every)) if stop_every else None
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=None if i % 4 == 1 else i,
            max_tokens=rng.randint(1, 30),
            stop_token_ids=stop,
            min_tokens=2 if i % 6 == 0 else 0,
            logprobs=2 if i % 5 == 0 else None,
        )
        for i in range(n)
    ]
    return prompts, params


def _run(async_scheduling, prompts, params, device="cpu", **kw):
    llm = LLM(
        zoo_model(MODEL),
        **engine_args(
            device,
            async_scheduling=async_scheduling,
            block_size=4,
            max_model_len=256,
            max_num_batched_tokens=64,
            seed=0,
            **kw,
        ),
    )
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.check_invariants()
        stats = llm.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
        return [
            (
                o.outputs[0].token_ids,
                o.outputs[0].finish_reason,
                o.outputs[0].stop_reason,
                o.outputs[0].cumulative_logprob,
                o.outputs[0].logprobs,
            )
            for o in outs
        ], stats
    finally:
        llm.close()


def _assert_same(want, got, tol=1e-4):
    """Tokens, finish and stop reasons exactly; logprobs within float32 noise: a different batch
    composition (a stopped request computed once more, another preemption pattern, so another
    prefill/decode split) changes float32 rounding, never a token on these peaked models."""
    assert [w[:3] for w in want] == [g[:3] for g in got]
    for (_, _, _, want_cum, want_lps), (_, _, _, got_cum, got_lps) in zip(want, got):
        assert (want_cum is None) == (got_cum is None)
        if want_cum is not None:
            assert abs(want_cum - got_cum) < tol * max(1, len(want_lps or []))
        if want_lps is not None:
            for w, g in zip(want_lps, got_lps, strict=True):
                assert w.keys() == g.keys()
                assert all(abs(w[t].logprob - g[t].logprob) < tol and w[t].rank == g[t].rank for t in w)


@pytest.fixture
def pipelined(monkeypatch):
    """Counts the steps launched while another was in flight, and their placeholder rows."""
    counts = {"advanced": 0, "placeholder_rows": 0}
    advance, build = engine_module.LLMEngine._advance, engine_module.build_model_input

    def counting_advance(self, launched):
        counts["advanced"] += 1
        return advance(self, launched)

    def counting_build(*args, **kwargs):
        mi, plan = build(*args, **kwargs)
        counts["placeholder_rows"] += len(mi.pending_rows)
        return mi, plan

    monkeypatch.setattr(engine_module.LLMEngine, "_advance", counting_advance)
    monkeypatch.setattr(engine_module, "build_model_input", counting_build)
    return counts


@pytest.mark.parametrize(
    "blocks,stop_every",
    [(400, None), (400, 7), (40, None), (40, 7)],
    ids=["ample", "ample-stops", "starved", "starved-stops"],
)
def test_async_equals_sync(pipelined, blocks, stop_every, device):
    prompts, params = _workload(stop_every=stop_every)
    want, sync_stats = _run(False, prompts, params, device, num_kvcache_blocks=blocks)
    assert pipelined["advanced"] == 0
    got, stats = _run(True, prompts, params, device, num_kvcache_blocks=blocks)
    _assert_same(want, got)
    assert pipelined["advanced"] > 0 and pipelined["placeholder_rows"] > 0, pipelined
    if blocks == 40:
        assert stats["preemptions"] > 0 and sync_stats["preemptions"] > 0
    if stop_every:
        assert any(reason == "stop" for _, reason, *_ in want)


def test_async_prefix_cache_and_chunks_match(device):
    rng = random.Random(3)
    shared = [rng.randrange(1, VOCAB) for _ in range(21)]
    prompts = [shared + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want, _ = _run(False, prompts, params, device, max_num_seqs=4)
    got, stats = _run(True, prompts, params, device, max_num_seqs=4)
    _assert_same(want, got)
    assert stats["prefix_cache_hit_tokens"] > 0


def test_abort_and_add_while_a_step_is_in_flight(device):
    prompts, _ = _workload(n=6, seed=4)
    llm = LLM(zoo_model(MODEL), **engine_args(device, async_scheduling=True, block_size=4, max_model_len=256, seed=0))
    try:
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert engine._inflight is not None, "no step in flight: the test checks nothing"
        aborted = engine.abort_request("r2")
        assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
        engine.add_request("late", prompts[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:  # step() also reports streaming progress
                    done[out.request_id] = out
        assert set(done) == {"r0", "r1", "r3", "r4", "r5", "late"}
        assert all(len(done[r].outputs[0].token_ids) == 25 for r in done if r != "late")
        engine.check_invariants()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.close()


def test_interrupt_mid_pipeline_leaves_the_engine_clean(monkeypatch, device):
    """A KeyboardInterrupt while step N completes (step N+1 already queued): generate aborts its
    requests, no placeholder token survives, every block returns, the engine serves again."""
    prompts, _ = _workload(n=6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(zoo_model(MODEL), **engine_args(device, async_scheduling=True, block_size=4, max_model_len=256, seed=0))
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm.llm_engine
        complete, calls = engine_module.LLMEngine._complete, []

        def interrupted(self, launched):
            calls.append(self._inflight is not None)
            if len(calls) == 6:
                assert self._inflight is not None, "no step in flight at the interrupt"
                raise KeyboardInterrupt
            return complete(self, launched)

        monkeypatch.setattr(engine_module.LLMEngine, "_complete", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(engine_module.LLMEngine, "_complete", complete)
        assert not engine.requests and not engine.has_unfinished_requests()
        engine.check_invariants()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        llm.close()
