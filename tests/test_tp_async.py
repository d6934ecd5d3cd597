"""Async scheduling with tensor parallelism (TP=2, gloo on CPU): the tokens, finish and stop
reasons, logprobs and prompt logprobs of synchronous TP=2 and of TP=1, under preemption in a
small KV cache, with stop strings, greedy and seeded sampling; a step abandoned by an
interrupted engine; a worker killed mid-run (a named error, no process left behind).

Rank 0 samples and broadcasts the tokens (``ModelRunner._share_sampled``): the mutant
``tp_ranks_sample_apart`` (tests/mutants/) lets rank 1 draw its own with another seed, which the
equivalence test catches through the seeded rows. The GPU run (NCCL, CUDA graphs) is
``scripts/tp_gpu_check.sh``.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import nanovllm.engine.engine as engine_module
from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.test_tp import _live_children, _wait_gone, _worker_pids

MODEL = "qwen3-gqa2-hd64-tied"
VOCAB = ZOO[MODEL].vocab_size
# a small cache (40 blocks of 4 tokens for 16 requests of up to 64 tokens): preemption and recompute
ARGS = {
    "device": "cpu",
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 256,
    "max_num_batched_tokens": 64,
    "num_kvcache_blocks": 40,
    "seed": 0,
}
TOL = 1e-4  # TP=2 sums its GEMMs in another order than TP=1: float32 rounding, never a token here


def _workload(n: int = 16, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    # the zoo's word-level tokenizer spells token i "w<i>": "w1" ends a text at any w1, w1x, w1xx
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=None if i % 2 else 100 + i,
            max_tokens=rng.randint(4, 24),
            stop=["w1", "w7"] if i % 3 == 0 else None,
            logprobs=2 if i % 4 == 0 else None,
            prompt_logprobs=2 if i % 4 == 1 else None,
        )
        for i in range(n)
    ]
    return prompts, params


def _summary(outs) -> list:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            o.outputs[0].cumulative_logprob,
            o.outputs[0].logprobs,
            o.prompt_logprobs,
        )
        for o in outs
    ]


def _values(logprob_dicts) -> tuple[list, torch.Tensor]:
    keys, vals = [], []
    for d in logprob_dicts or []:
        if d is None:  # the first prompt position
            keys.append(None)
            continue
        keys.append(sorted((t, lp.rank) for t, lp in d.items()))
        vals += [d[t].logprob for t in sorted(d)]
    return keys, torch.tensor(vals, dtype=torch.float64)


def _assert_same(want: list, got: list, what: str) -> None:
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w[:3] == g[:3], f"{what}: request {i} tokens/finish/stop differ"
        assert (w[3] is None) == (g[3] is None)
        if w[3] is not None:
            assert abs(w[3] - g[3]) < TOL * max(1, len(w[0])), f"{what}: request {i} cumulative logprob"
        for which, a, b in (("logprobs", w[4], g[4]), ("prompt_logprobs", w[5], g[5])):
            assert (a is None) == (b is None), f"{what}: request {i} {which}"
            (ka, va), (kb, vb) = _values(a), _values(b)
            assert ka == kb, f"{what}: request {i} {which} token ids / ranks differ"
            torch.testing.assert_close(vb, va, atol=TOL, rtol=TOL, msg=f"{what}: request {i} {which}")


@pytest.fixture(scope="module")
def tp2_async():
    with LLM(zoo_model(MODEL), tensor_parallel_size=2, async_scheduling=True, **ARGS) as llm:
        yield llm


@pytest.fixture
def placeholder_rows(monkeypatch):
    """Counts the placeholder rows of the steps built (rows filled on the device)."""
    counts = {"rows": 0}
    build = engine_module.build_model_input

    def counting_build(*args, **kwargs):
        mi, plan = build(*args, **kwargs)
        counts["rows"] += len(mi.pending_rows)
        return mi, plan

    monkeypatch.setattr(engine_module, "build_model_input", counting_build)
    return counts


def test_tp2_async_equals_sync_and_tp1(tp2_async, placeholder_rows):
    prompts, params = _workload()
    with LLM(zoo_model(MODEL), async_scheduling=False, **ARGS) as llm:
        tp1 = _summary(llm.generate(prompts, params, use_tqdm=False))
    # TP=2 sync on the same workers (one start-up less): the engine reads the switch at every step,
    # nothing is in flight between generate() calls, and the prefix cache is emptied in between
    engine = tp2_async.llm_engine
    engine.config.async_scheduling = False
    try:
        tp2_sync = _summary(tp2_async.generate(prompts, params, use_tqdm=False))
    finally:
        engine.config.async_scheduling = True
    assert placeholder_rows["rows"] == 0 and engine.num_pipelined_steps == 0
    assert tp2_async.reset_prefix_cache()
    before = tp2_async.stats()
    got = _summary(tp2_async.generate(prompts, params, use_tqdm=False))
    stats = tp2_async.stats()
    _assert_same(tp2_sync, got, "TP=2 async vs TP=2 sync")
    _assert_same(tp1, got, "TP=2 async vs TP=1")
    # the comparison covers what it claims: pipelined steps, device-filled rows, preemption,
    # stop strings, seeded random rows that sampled something else than greedy would
    assert stats["pipelined_steps"] > before["pipelined_steps"] and placeholder_rows["rows"] > 0
    assert stats["preemptions"] > before["preemptions"]
    assert any(isinstance(s[2], str) for s in got), "no request stopped on a stop string"
    assert any(s[5] is not None for s in got) and any(s[4] is not None for s in got)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_tp2_step_abandoned_by_an_interrupt(tp2_async, monkeypatch):
    """A KeyboardInterrupt while step N completes (N+1 already launched): the workers drop step
    N's result when N+1's is asked for (tickets), the engine is clean and serves the same tokens."""
    prompts, _ = _workload(n=6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in tp2_async.generate(prompts, params, use_tqdm=False)]
    engine = tp2_async.llm_engine
    complete, calls = engine_module.LLMEngine._complete, []

    def interrupted(self, launched):
        calls.append(1)
        if len(calls) == 6:
            assert self._inflight is not None, "no step in flight at the interrupt"
            raise KeyboardInterrupt
        return complete(self, launched)

    monkeypatch.setattr(engine_module.LLMEngine, "_complete", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tp2_async.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(engine_module.LLMEngine, "_complete", complete)
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [o.outputs[0].token_ids for o in tp2_async.generate(prompts, params, use_tqdm=False)] == want


def test_tp2_async_killed_worker_raises_quickly_and_leaves_no_process():
    before = _live_children()
    killed = {}

    def kill_rank1(event):
        if event.step == 3 and not killed:
            killed["at"] = time.monotonic()
            os.kill(_worker_pids(llm)[1], signal.SIGKILL)

    llm = LLM(
        zoo_model(MODEL),
        tensor_parallel_size=2,
        async_scheduling=True,
        trace=kill_rank1,
        **{**ARGS, "num_kvcache_blocks": 400},
    )
    pids = _worker_pids(llm)
    prompts, _ = _workload(n=8, seed=1)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 8, use_tqdm=False)
    assert killed and llm.llm_engine.num_pipelined_steps > 0
    assert time.monotonic() - killed["at"] < 10.0
    llm.close()
    assert _wait_gone(pids, timeout=5) == []
    assert _live_children() - before == set()


# --------------------------------------------------------------- GPU, NCCL (scripts/tp_gpu_check.sh)
@pytest.mark.multi_gpu
def test_tp2_async_equals_sync_and_tp1_nccl_cuda_graphs():
    """The same comparison over NCCL with CUDA graphs (float32: only the split GEMM sums differ)."""
    args = {**ARGS, "device": "cuda", "enforce_eager": False, "max_num_seqs": 16}
    prompts, params = _workload()
    runs = {}
    for name, tp, mode in (("tp1", 1, False), ("tp2 sync", 2, False), ("tp2 async", 2, True)):
        with LLM(zoo_model(MODEL), tensor_parallel_size=tp, async_scheduling=mode, **args) as llm:
            runs[name] = _summary(llm.generate(prompts, params, use_tqdm=False))
            stats = llm.stats()
        assert (stats["pipelined_steps"] > 0) == mode and stats["preemptions"] > 0, (name, stats)
        torch.cuda.empty_cache()
    _assert_same(runs["tp2 sync"], runs["tp2 async"], "TP=2 async vs TP=2 sync (CUDA)")
    _assert_same(runs["tp1"], runs["tp2 async"], "TP=2 async vs TP=1 (CUDA)")
