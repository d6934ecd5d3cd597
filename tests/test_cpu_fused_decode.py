"""A CPU decode step's layers in one C call (``nanovllm/models/cpu_decode.py``): the Python layers'
bits, where it applies, and the Python layers wherever something must see their calls."""

from __future__ import annotations

import functools

import pytest
import torch

from nanovllm import cpu_kernels
from nanovllm.layers import cpu_linear
from nanovllm.models import cpu_decode

pytestmark = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_linear.rows_enabled())
    or cpu_kernels.rms_norm_lanes() is None
    or cpu_kernels.silu_lanes() is None,
    reason="the fused decode layers need every CPU kernel of the Python layers: oneDNN (weights are packed where "
    "it is), the rows kernel (AVX-512 or AVX2, NANOVLLM_CPU_KERNELS and NANOVLLM_CPU_ROWS_LINEAR not 0) and the C "
    "RMSNorm and SiLU (torch's lane counts found)",
)


def _engine(name: str, prompts: int = 5):
    pytest.importorskip("transformers", reason="the zoo builder writes the config with transformers")
    from conformance.zoo import ZOO, zoo_model
    from nanovllm import LLM
    from tests.conftest import engine_args, prompts_for

    llm = LLM(zoo_model(name), **engine_args("cpu", block_size=16, seed=0))
    lengths = [(3, 17, 40, 9, 64)[i % 5] + i for i in range(prompts)]
    return llm, prompts_for(ZOO[name].vocab_size, lengths, seed=1)


def _outputs(llm, prompts) -> list:
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in o.outputs[0].logprobs])
        for o in out
    ]


def _counting_runs(monkeypatch) -> list[int]:
    rows = []
    run = cpu_decode.FusedDecode.run

    def counted(self, hidden, positions, meta):
        rows.append(hidden.shape[0])
        return run(self, hidden, positions, meta)

    monkeypatch.setattr(cpu_decode.FusedDecode, "run", counted)
    return rows


@pytest.mark.parametrize(
    "name,requests",
    [
        ("llama-mha-hd64", 5),
        ("qwen2-gqa2-hd64", 5),
        ("llama-rope3-bias", 5),
        ("llama-1kv-hd128", 5),
        ("llama-wide-mlp", 24),
    ],
)
def test_fused_decode_steps_give_the_python_layers_bits(monkeypatch, name, requests):
    """Greedy tokens and top-3 logprobs, the fused layers against the Python layers
    (``NANOVLLM_CPU_FUSED_DECODE=0``), bitwise: a Llama, a Qwen2 (q/k/v biases), a Llama with llama3
    RoPE scaling and biases, one KV head of 128 (decode batches of 5: one row tile of the rows kernel),
    and 24 requests on an MLP of 1,536 (the rows kernel's K chunks, SiLU in two pieces on two threads).
    Control: the fused attention's scale a few float32 steps off, and the comparison fails."""
    llm, prompts = _engine(name, requests)
    try:
        ran = _counting_runs(monkeypatch)
        fused = _outputs(llm, prompts)
        assert ran and max(ran) == len(prompts), "the fused layers did not run: the comparison would be vacuous"
        monkeypatch.setenv(cpu_decode.SWITCH, "0")
        ran.clear()
        python = _outputs(llm, prompts)
        assert not ran
        assert fused == python
        monkeypatch.delenv(cpu_decode.SWITCH)
        model = llm.llm_engine.executor.runner.model.model
        structures = model.__dict__["_fused_decode"].fused
        structures.model.scale *= 1 + 2**-22  # a few float32 steps (two at 0.125, d = 64)
        assert _outputs(llm, prompts) != python, "the control shows nothing"
    finally:
        llm.close()


def test_qwen3_keeps_the_python_layers(monkeypatch):
    """Qwen3's q/k norm has no place in the fused layers: its decode steps run in Python."""
    llm, prompts = _engine("qwen3-gqa4-hd128")
    try:
        ran = _counting_runs(monkeypatch)
        _outputs(llm, prompts[:2])
        assert not ran
        assert llm.llm_engine.executor.runner.model.model.__dict__["_fused_decode"].fused is None
    finally:
        llm.close()


def test_a_replaced_kernel_wrapper_sees_the_decode_steps(monkeypatch):
    """A wrapper put around a kernel the Python layers call (a profiler's, a test's, an injected bug)
    sees the decode steps too: they run in Python while it is in place. Control: without it, the
    fused layers run them."""
    llm, prompts = _engine("llama-mha-hd64")
    try:
        ran = _counting_runs(monkeypatch)
        seen = []
        rms_norm = cpu_kernels.rms_norm
        monkeypatch.setattr(cpu_kernels, "rms_norm", lambda x, *a: seen.append(x.shape[0]) or rms_norm(x, *a))
        _outputs(llm, prompts[:3])
        assert 3 in seen and not ran
        seen.clear()
        monkeypatch.setattr(
            cpu_kernels, "rms_norm", functools.wraps(rms_norm)(lambda x, *a: seen.append(x.shape[0]) or rms_norm(x, *a))
        )
        _outputs(llm, prompts[:3])
        assert 3 in seen and not ran, "a wrapper that copies the function's name went unseen"
        monkeypatch.setattr(cpu_kernels, "rms_norm", rms_norm)
        _outputs(llm, prompts[:3])
        assert 3 in ran
    finally:
        llm.close()


def test_a_bad_slot_or_position_stops_layer_0_with_the_cache_untouched():
    """A slot outside the cache and a position outside the RoPE tables are refused by layer 0's own
    kernel before it writes, with the layer and the kernel named; the engine then runs as before."""
    from nanovllm.attention.metadata import AttentionMetadata

    llm, prompts = _engine("llama-mha-hd64")
    try:
        before = _outputs(llm, prompts[:2])
        model = llm.llm_engine.executor.runner.model.model
        structures = model.__dict__["_fused_decode"].fused
        caches = [
            t.clone() for layer in model.layers for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)
        ]
        num_slots = structures.model.num_blocks * structures.model.block_size

        def meta(slot: int) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=torch.tensor([slot]),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([1], dtype=torch.int32),
                block_tables=torch.zeros(1, 1, dtype=torch.int32),
                max_query_len=1,
                max_seq_len=1,
                block_size=structures.model.block_size,
                query_start_loc_cpu=[0, 1],
                seq_lens_cpu=[1],
            )

        hidden = torch.randn(1, structures.hidden)
        with pytest.raises(IndexError, match=f"layer 0's store_kv: slot_mapping has slot {num_slots} outside"):
            structures.run(hidden, torch.tensor([0]), meta(num_slots))
        rows = structures.model.table_rows
        with pytest.raises(IndexError, match=rf"layer 0's rotary_neox: a position \({rows}\) lies outside"):
            structures.run(hidden, torch.tensor([rows]), meta(0))
        after = [t for layer in model.layers for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)]
        # bitwise (as integers): unwritten cache slots hold whatever the allocator left, NaN bit patterns included,
        # which torch.equal would call unequal to themselves
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(caches, after))
        assert _outputs(llm, prompts[:2]) == before
    finally:
        llm.close()


def test_the_last_rope_row_and_the_last_cache_slot_give_the_python_layers_bits():
    """The accepting side of the limits above, at their edges: a row at the RoPE tables' last position,
    writing the cache's last slot, runs fused and gives the Python layers' outputs and cache bitwise.
    The limits are read from the tables and the cache themselves, not from the fused structures (a
    limit one short would agree with itself). Control: one position lower changes the outputs."""
    from nanovllm.attention.metadata import AttentionMetadata

    llm, _ = _engine("llama-mha-hd64")
    try:
        model = llm.llm_engine.executor.runner.model.model
        _outputs(llm, [[5, 6, 7]])  # builds the fused structures
        structures = model.__dict__["_fused_decode"].fused
        attn0 = model.layers[0].self_attn
        table_rows = attn0.rotary_emb.cos.shape[0]
        k_cache = attn0.attn.k_cache  # [blocks, kv heads, block size, head dim]
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
        assert (structures.model.table_rows, structures.model.num_blocks, structures.model.block_size) == (
            table_rows,
            num_blocks,
            block_size,
        )
        caches = [t for layer in model.layers for t in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)]
        last = num_blocks - 1  # only this block is written and read: only it is saved, filled, compared
        saved = [t[last].clone() for t in caches]
        torch.manual_seed(0)
        filled = [torch.randn_like(t[last]) for t in caches]  # finite: its other slots are read too
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([num_blocks * block_size - 1]),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([block_size], dtype=torch.int32),
            block_tables=torch.tensor([[last]], dtype=torch.int32),
            max_query_len=1,
            max_seq_len=block_size,
            block_size=block_size,
            query_start_loc_cpu=[0, 1],
            seq_lens_cpu=[block_size],
        )
        hidden = torch.randn(1, structures.hidden)

        def fill():
            for t, f in zip(caches, filled):
                t[last].copy_(f)

        def python_layers(position: int):
            fill()
            h, residual = hidden.clone(), None
            for layer in model.layers:
                h, residual = layer(torch.tensor([position]), h, residual, meta)
            return h, residual

        def bits(tensors):
            return [t.view(torch.int32).clone() for t in tensors]

        try:
            fill()
            fused = structures.run(hidden, torch.tensor([table_rows - 1]), meta)
            fused_blocks = bits(t[last] for t in caches)
            python = python_layers(table_rows - 1)
            assert all(torch.isfinite(t).all() for t in python)
            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fused, python))
            assert all(torch.equal(a, b) for a, b in zip(fused_blocks, bits(t[last] for t in caches)))
            for got, before in zip(fused_blocks, bits(filled)):  # [kv heads, slots, dim]: the last slot only
                assert not torch.equal(got[:, -1], before[:, -1]) and torch.equal(got[:, :-1], before[:, :-1])
            lower = python_layers(table_rows - 2)
            assert not torch.equal(lower[0], python[0]), "the control shows nothing"
        finally:
            for t, s in zip(caches, saved):
                t[last].copy_(s)
    finally:
        llm.close()


def test_a_hook_set_after_the_first_decode_step_sees_the_next_ones(monkeypatch):
    """A forward hook registered on a layer's module once the fused layers are built (after a first
    generate) sees the later decode steps: whether to step aside is asked every step."""
    llm, prompts = _engine("llama-mha-hd64")
    try:
        ran = _counting_runs(monkeypatch)
        _outputs(llm, prompts[:3])
        assert 3 in ran
        ran.clear()
        mlp = llm.llm_engine.executor.runner.model.model.layers[1].mlp
        seen = []
        handle = mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
        try:
            _outputs(llm, prompts[:3])
        finally:
            handle.remove()
        assert 3 in seen and not ran
        _outputs(llm, prompts[:3])
        assert 3 in ran, "the fused layers did not come back once the hook was removed"
    finally:
        llm.close()


def test_a_layer_whose_sizes_differ_from_the_first_keeps_the_python_layers(monkeypatch):
    """The C side takes every layer's sizes from the first layer's: a layer whose product has another
    shape (here the down projection's K, as the packed weight says) makes ``build`` answer None, so the
    kernels never read past a weight. Control: the same model as it is builds."""
    llm, _ = _engine("llama-mha-hd64")
    try:
        model = llm.llm_engine.executor.runner.model.model
        assert cpu_decode.build(model) is not None
        down = model.layers[1].mlp.down_proj.packed_weight
        monkeypatch.setattr(down, "k", down.k + 16)
        assert cpu_decode.build(model) is None
    finally:
        llm.close()


def test_new_caches_get_new_structures(monkeypatch):
    """The runner attaches new caches after sizing (and empties them at close): the next decode step
    builds the structures again, pointing at the new caches, with the same results. Control: with the
    rebuild rule answering "current" always, the structures keep pointing at the old caches (kept
    alive here, so that the control writes only into memory it owns)."""
    llm, prompts = _engine("llama-mha-hd64")
    try:
        before = _outputs(llm, prompts[:3])
        model = llm.llm_engine.executor.runner.model.model
        attns = [layer.self_attn.attn for layer in model.layers]

        def new_caches() -> list:
            old = [(a.k_cache, a.v_cache) for a in attns]
            for a in attns:
                a.k_cache, a.v_cache = a.k_cache.clone(), a.v_cache.clone()
            return old

        new_caches()
        assert _outputs(llm, prompts[:3]) == before
        layer0 = model.__dict__["_fused_decode"].fused.layers[0]
        assert (layer0.k_cache, layer0.v_cache) == (attns[0].k_cache.data_ptr(), attns[0].v_cache.data_ptr())

        monkeypatch.setattr(cpu_decode._Built, "current", lambda self, model: True)
        kept = new_caches()
        _outputs(llm, prompts[:3])
        layer0 = model.__dict__["_fused_decode"].fused.layers[0]
        assert layer0.k_cache != attns[0].k_cache.data_ptr(), "the control shows nothing"
        assert layer0.k_cache == kept[0][0].data_ptr()
    finally:
        llm.close()
