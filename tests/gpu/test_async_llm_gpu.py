"""AsyncLLM on a GPU: the step loop runs in its own thread (CUDA graphs, async scheduling and
the fused sampler were set up by the loading thread); concurrent callers get what offline
generate gives, and a cancelled caller's blocks come back."""

from __future__ import annotations

import asyncio

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.sampling_params import RequestOutputKind
from tests.conftest import prompts_for

pytestmark = pytest.mark.gpu
MODEL = "qwen3-gqa4-hd128"


def test_async_llm_on_cuda_matches_offline():
    args = dict(device="cuda", dtype="float32", block_size=16, max_model_len=512, kv_cache_memory_gib=0.5)
    prompts = prompts_for(ZOO[MODEL].vocab_size, [4 + (i * 13) % 90 for i in range(24)], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(zoo_model(MODEL), **args) as offline:
        want = [o.outputs[0].token_ids for o in offline.generate(prompts, greedy, use_tqdm=False)]
    engine = AsyncLLM.from_engine_args(zoo_model(MODEL), **args)
    assert engine.engine.config.async_scheduling and not engine.engine.config.enforce_eager

    async def one(i, p):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        ids = []
        async for out in engine.generate(p, params, f"r{i}"):
            ids += out.outputs[0].token_ids
        return ids

    async def main():
        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        task = asyncio.create_task(one(99, prompts[0]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)

        def check(e):
            e.check_invariants()
            return e.block_manager.num_free_blocks == e.block_manager.num_blocks and not e.requests

        return got, await engine.call(check)

    try:
        got, clean = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == want and clean
