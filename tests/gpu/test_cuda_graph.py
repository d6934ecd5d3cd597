"""Decode CUDA graphs: replay equals eager, every batch size replays, padding writes nothing.

max_num_seqs is 45 (not a multiple of 16), so the captured sizes are
1, 2, 4, 8, 16, 24, 32, 40, 45 and most batches are padded.
"""

from __future__ import annotations

import random

import pytest
import torch

from conformance.zoo import zoo_model
from nanovllm.core.model_input import ModelInput

pytestmark = pytest.mark.gpu

MAX_SEQS, BLOCK, MAX_LEN = 45, 16, 512
WIDTH = MAX_LEN // BLOCK


def _llm(dtype: str, enforce_eager: bool):
    from nanovllm import LLM

    return LLM(
        zoo_model("qwen3-gqa4-hd128"),
        device="cuda",
        dtype=dtype,
        block_size=BLOCK,
        max_num_seqs=MAX_SEQS,
        max_model_len=MAX_LEN,
        num_kvcache_blocks=MAX_SEQS * WIDTH + 4,
        enforce_eager=enforce_eager,
    )


@pytest.fixture(scope="module")
def runner():
    llm = _llm("bfloat16", enforce_eager=False)
    r = llm.llm_engine.executor.runner
    assert r.graphs is not None and r.graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40, 45]
    for layer in r.attn_layers:  # known contents everywhere (torch.empty may hold NaN)
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    yield r
    llm.llm_engine.close()


def _table(i: int) -> list[int]:
    return list(range(i * WIDTH + 1, (i + 1) * WIDTH + 1))  # block 0 stays unused


def _prefill(runner, lens: list[int], rng: random.Random) -> None:
    """Fresh prompts of these lengths for sequences 0, 1, ... in steps within the token budget."""
    budget, group = runner.config.max_num_batched_tokens, []
    for i, n in enumerate(lens):
        if group and sum(lens[j] for j in group) + n > budget:
            _prefill_step(runner, group, lens, rng)
            group = []
        group.append(i)
    _prefill_step(runner, group, lens, rng)


def _prefill_step(runner, seqs: list[int], lens: list[int], rng: random.Random) -> None:
    mi = ModelInput([], [], [], [0], [], [])
    for i in seqs:
        n = lens[i]
        table = _table(i)
        mi.input_ids += [rng.randrange(1000) for _ in range(n)]
        mi.positions += list(range(n))
        mi.slot_mapping += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        mi.query_start_loc.append(mi.query_start_loc[-1] + n)
        mi.seq_lens.append(n)
        mi.block_tables.append(table[: -(-n // BLOCK)])
    with torch.inference_mode():
        runner._forward(mi)


def _decode_input(lens: list[int], rng: random.Random) -> ModelInput:
    mi = ModelInput([], [], [], [0], [], [])
    for i, n in enumerate(lens):  # n tokens cached; the new token sits at position n
        table = _table(i)[: n // BLOCK + 1]
        mi.input_ids.append(rng.randrange(1000))
        mi.positions.append(n)
        mi.slot_mapping.append(table[n // BLOCK] * BLOCK + n % BLOCK)
        mi.query_start_loc.append(i + 1)
        mi.seq_lens.append(n + 1)
        mi.block_tables.append(table)
        mi.sample_rows.append(i)
    return mi


@pytest.mark.parametrize("batch", [1, 3, 7, 9, 17, 25, 45])
def test_graph_equals_eager_and_padding_writes_nothing(runner, batch):
    rng = random.Random(batch)
    lens = [rng.randint(1, MAX_LEN - 2) for _ in range(batch)]
    _prefill(runner, lens, rng)
    mi = _decode_input(lens, rng)
    padded = runner.graphs.padded_size(mi)
    assert padded == min(s for s in runner.graphs.sizes if s >= batch)
    before = [(a.k_cache.clone(), a.v_cache.clone()) for a in runner.attn_layers]
    runner.graphs.out.fill_(float("nan"))
    with torch.inference_mode():
        graph_hidden, rows = runner._forward(mi)
        graph_hidden = graph_hidden.clone()
        changed = set()
        for (k0, v0), a in zip(before, runner.attn_layers):
            for old, new in ((k0, a.k_cache), (v0, a.v_cache)):
                per_slot = (old != new).flatten(2).any(-1).flatten()  # [num_blocks * BLOCK]
                changed |= set(per_slot.nonzero().flatten().tolist())
        assert changed <= set(mi.slot_mapping), f"graph wrote slots {sorted(changed - set(mi.slot_mapping))[:8]}"
        assert changed, "the decode step wrote no K/V at all"
        # eager over the very same padded inputs: bitwise equal
        step = runner.inputs.stage(mi, pad_to=padded)
        eager_padded = runner.model(step.input_ids, step.positions, step.meta)[:batch]
        # eager without padding: equal up to bf16 rounding of differently shaped matmuls
        step = runner.inputs.stage(mi)
        eager = runner.model(step.input_ids, step.positions, step.meta)
    assert rows == slice(0, batch)
    assert not torch.isnan(graph_hidden).any(), "graph left output rows unwritten"
    err = ((graph_hidden.float() - eager.float()).norm() / eager.float().norm()).item()
    assert err < 2e-2, f"graph vs unpadded eager at batch {batch}: relative error {err:.3e}"
    max_diff = (graph_hidden.float() - eager_padded.float()).abs().max().item()
    assert torch.equal(graph_hidden, eager_padded), (
        f"graph != eager over the same padded inputs at batch {batch} (padded {padded}): max diff {max_diff}"
    )


def test_every_batch_size_replays(runner):
    rng = random.Random(0)
    lens = [rng.randint(1, 64) for _ in range(MAX_SEQS)]
    _prefill(runner, lens, rng)
    for batch in range(1, MAX_SEQS + 1):
        mi = _decode_input(lens[:batch], rng)
        with torch.inference_mode():
            hidden, _ = runner._forward(mi)
        assert hidden.shape[0] == batch and torch.isfinite(hidden).all(), f"batch {batch}"


def test_generate_graph_equals_eager_float32():
    """End to end, float32 and greedy: requests finish one by one, so the running batch
    shrinks through every size from 45 to 1 (most of them padded)."""
    from nanovllm import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(1, 200))] for _ in range(MAX_SEQS)]
    params = [SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True) for i in range(MAX_SEQS)]
    outs = {}
    for eager in (True, False):
        llm = _llm("float32", enforce_eager=eager)
        assert (llm.llm_engine.executor.runner.graphs is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.close()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("stops", [False, True], ids=["length-finishes", "stop-tokens"])
def test_async_scheduling_equals_sync_with_graphs(stops):
    """Step N+1 launched before step N's tokens are read back (its inputs filled on the device
    from step N's sampled tokens) gives the tokens of synchronous scheduling: greedy rows, and
    seeded random rows drawn by the fused sampler (their draws depend on seed and index only)."""
    import nanovllm.engine.engine as engine_module
    from nanovllm import LLM, SamplingParams

    rng = random.Random(11)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(1, 200))] for _ in range(MAX_SEQS)]
    stop = list(range(0, 1000, 13)) if stops else None
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.9,
            seed=i,
            max_tokens=rng.randint(1, 60),
            ignore_eos=not stops,
            stop_token_ids=stop,
        )
        for i in range(MAX_SEQS)
    ]
    advanced = []
    orig = engine_module.LLMEngine._advance
    outs = {}
    try:
        engine_module.LLMEngine._advance = lambda self, launched: (advanced.append(1), orig(self, launched))[1]
        for async_scheduling in (False, True):
            llm = LLM(
                zoo_model("qwen3-gqa4-hd128"),
                device="cuda",
                dtype="float32",
                block_size=BLOCK,
                max_num_seqs=MAX_SEQS,
                max_model_len=MAX_LEN,
                num_kvcache_blocks=MAX_SEQS * WIDTH + 4,
                async_scheduling=async_scheduling,
            )
            assert llm.llm_engine.executor.runner.graphs is not None
            outs[async_scheduling] = [
                (o.outputs[0].token_ids, o.outputs[0].finish_reason)
                for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            llm.llm_engine.check_invariants()
            llm.llm_engine.close()
    finally:
        engine_module.LLMEngine._advance = orig
    assert len(advanced) > 10, "async scheduling never pipelined a step"
    assert outs[True] == outs[False]
    if stops:
        assert any(reason == "stop" for _, reason in outs[False])
