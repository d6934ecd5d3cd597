"""attention/torch_ref.py: paged attention through block tables equals dense causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.attention import torch_ref
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.core.utils import cdiv


def _dense(q, k, v, scale):
    """Reference by SDPA on contiguous K/V, bottom-right aligned causal mask, GQA expanded."""
    n_q, n_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1).float()


def _build(seq_specs, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """seq_specs: [(context_len, query_len)]. Writes every sequence's K/V into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(cdiv(c, block_size) for c, _ in seq_specs) + 3
    k_cache = torch.full((total_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(total_blocks, generator=g).tolist()
    tables, qs, ks, vs, qsl = [], [], [], [], [0]
    for ctx, n_q in seq_specs:
        nb = -(-ctx // block_size)
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        torch_ref.store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        qs.append(torch.randn(n_q, num_heads, head_dim, generator=g))
        ks.append(k)
        vs.append(v)
        qsl.append(qsl[-1] + n_q)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in seq_specs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in seq_specs),
        max_seq_len=max(c for c, _ in seq_specs),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[c for c, _ in seq_specs],
    )
    return torch.cat(qs), ks, vs, k_cache, v_cache, meta


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (4, 2, 64), (8, 2, 128), (4, 1, 32)])
def test_paged_attention_equals_dense(block_size, heads, kv_heads, head_dim):
    specs = [(1, 1), (17, 17), (40, 5), (33, 1), (16, 16), (70, 23)]  # prefill, chunk after a prefix, decode
    q, ks, vs, k_cache, v_cache, meta = _build(specs, heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
    assert not out.isnan().any(), "read an unwritten (NaN) slot"
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        torch.testing.assert_close(out[s:e], _dense(q[s:e], ks[i], vs[i], scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_batched_decode_equals_loop(block_size):
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (99, 1)]
    q, _, _, k_cache, v_cache, meta = _build(specs, 8, 2, 64, block_size, seed=3)
    loop = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125)
    batched = torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(batched, loop, atol=1e-6, rtol=1e-6)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 2)
    torch_ref.store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 2)
    assert flat[5].eq(1).all() and flat[0].eq(1).all()
    assert flat.sum() == 4, "slot -1 wrote something"


def test_negative_control_wrong_block_table_is_caught():
    """The dense comparison above must fail when K/V are read through a wrong block table."""
    specs = [(40, 4)]
    q, ks, vs, k_cache, v_cache, meta = _build(specs, 4, 2, 64, 16)
    meta.block_tables = meta.block_tables.flip(1)
    out = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, _dense(q, ks[0], vs[0], 0.125), atol=1e-5, rtol=1e-5)


def _head_major_by_store(k_cache, v_cache, meta, seq_specs, ks, vs):
    """A head-major cache written through ``store_kv(head_major=True)`` with the slots the
    slot-major one was written with (unwritten slots NaN in both)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    hk = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=k_cache.dtype)
    hv = torch.full_like(hk, float("nan"))
    for i, (ctx, _) in enumerate(seq_specs):
        table = meta.block_tables[i].tolist()
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        torch_ref.store_kv(ks[i], vs[i], hk, hv, slots, head_major=True)
    return hk, hv


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (4, 1, 32)])
def test_head_major_cache_gives_bitwise_the_slot_major_results(block_size, heads, kv_heads, head_dim):
    """The CPU backend's head-major cache ([block, kv_head, slot, d]): ``store_kv`` puts each
    token where the slot-major cache has it (the same tensor, transposed), and prefill, chunked
    and batched-decode attention read back bitwise the slot-major results."""
    scale = head_dim**-0.5
    for specs in ([(1, 1), (17, 17), (40, 5), (33, 1), (70, 23)], [(1, 1), (33, 1), (70, 1), (16, 1)]):
        q, ks, vs, k_cache, v_cache, meta = _build(specs, heads, kv_heads, head_dim, block_size)
        hk, hv = _head_major_by_store(k_cache, v_cache, meta, specs, ks, vs)
        for got_cache, slot_major in ((hk, k_cache), (hv, v_cache)):
            assert torch.allclose(got_cache, slot_major.permute(0, 2, 1, 3), equal_nan=True, atol=0, rtol=0), (
                "store_kv(head_major=True) put a token elsewhere"
            )
        want = torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
        got = torch_ref.paged_attention(q, hk, hv, meta, scale, head_major=True)
        assert torch.equal(got, want)
        if meta.is_decode_only:
            want = torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, scale)
            got = torch_ref.paged_decode_batched(q, hk, hv, meta, scale, head_major=True)
            assert torch.equal(got, want)
            # a control: the head-major cache read as slot-major is not the same attention
            wrong = torch_ref.paged_decode_batched(q, hk.view(k_cache.shape), hv.view(v_cache.shape), meta, scale)
            if kv_heads > 1 and block_size > 1:
                assert not torch.allclose(wrong, want, equal_nan=True)


def test_the_torch_backend_allocates_and_reads_a_head_major_cache(monkeypatch):
    """The CPU engine's cache is head-major (the backend says its shape); the Triton backend's
    shape stays slot-major, the view its kernels read, over head-major storage by default."""
    from conformance.zoo import zoo_model
    from nanovllm import LLM
    from nanovllm.attention.backends import TorchBackend
    from nanovllm.attention.triton_backend import TritonBackend

    assert TorchBackend.kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 64)
    assert TritonBackend.kv_cache_shape(10, 16, 2, 64) == (10, 16, 2, 64)
    cache = TritonBackend.new_kv_cache(10, 16, 2, 64, torch.float16, torch.device("cpu"))
    assert cache.shape == (10, 16, 2, 64) and cache.stride() == (2 * 16 * 64, 64, 16 * 64, 1)
    assert TorchBackend.new_kv_cache(10, 16, 2, 64, torch.float32, "cpu").is_contiguous()
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "HEAD_MAJOR_CACHE", False)  # the A/B switch: slot-major storage
    cache = TritonBackend.new_kv_cache(10, 16, 2, 64, torch.float16, torch.device("cpu"))
    assert cache.shape == (10, 16, 2, 64) and cache.is_contiguous()
    llm = LLM(zoo_model("qwen3-gqa2-hd64-tied"), device="cpu", kv_cache_memory_gib=0.01)
    attn = next(m for m in llm.llm_engine.executor.runner.model.modules() if hasattr(m, "k_cache"))
    assert attn.k_cache.shape[1:] == (attn.num_kv_heads, llm.llm_engine.config.block_size, attn.head_dim)
