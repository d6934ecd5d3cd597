"""attention/cpu_kernels: the compiled CPU decode attention and cache writes equal the PyTorch oracle,
depend on nothing but a sequence's own blocks, and step aside (to the PyTorch path) where they cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from nanovllm import cpu_kernels
from nanovllm.attention import torch_ref
from nanovllm.attention.backends import TorchBackend
from tests.test_attention_ref import _build

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="the CPU kernels could not be built here (no C compiler; see the log)"
)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(0, 2, 1, 3).contiguous()


def _decode(q, k_cache, v_cache, meta, scale):
    return cpu_kernels.paged_decode(
        q, _head_major(k_cache), _head_major(v_cache), meta.block_tables, meta.seq_lens, scale
    )


# the longest row sizes each thread's scratch (its keys rounded up to 16, plus room for the portable
# loop's group denominators): longest rows of 32 and 48 keys sit on that rounding's edge, where a
# scratch without the room overflows (seen under the sanitizers: test_cpu_kernels_sanitized.py)
DECODE_SPECS = [[(1, 1)], [(16, 1), (17, 1), (1, 1)], [(300, 1), (5, 1), (64, 1), (33, 1)], [(32, 1), (16, 1)]]


# head_dim 24 is not a multiple of 16: the portable loop instead of the AVX-512 one; a group of 16
# heads takes four tiles of the output pass, head_dim 128 tiles of two
HEAD_SHAPES = [(4, 4, 64), (9, 3, 64), (16, 1, 64), (8, 2, 128), (4, 1, 32), (6, 2, 24)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("specs", DECODE_SPECS)
def test_decode_kernel_equals_the_oracle(block_size, heads, kv_heads, head_dim, specs):
    """Every sequence's row equals the per-sequence PyTorch oracle (float32: only the order of the
    sums differs), GQA groups of 1-4, block edges, a one-token context."""
    q, _, _, k_cache, v_cache, meta = _build(specs, heads, kv_heads, head_dim, block_size, seed=block_size + heads)
    scale = head_dim**-0.5
    want = torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
    got = _decode(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


PREFILL_SPECS = [
    [(40, 40)],
    [(70, 30), (5, 5), (33, 1)],
    [(300, 17), (16, 16), (1, 1)],
    [(17, 2)] * 5,
    [(48, 48), (16, 3)],
]


def _prefill(q, k_cache, v_cache, meta, scale, rows=None):
    rows = rows or cpu_kernels.prefill_rows(meta.query_start_loc_cpu, meta.seq_lens_cpu)
    return cpu_kernels.paged_attention(
        q, _head_major(k_cache), _head_major(v_cache), meta.block_tables, meta.seq_lens, scale, rows
    )


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("specs", PREFILL_SPECS)
def test_prefill_rows_equal_the_oracle(block_size, heads, kv_heads, head_dim, specs):
    """Prefill chunks (a whole prompt, a chunk after cached context, mixed with decode rows): each
    query row sees its sequence's slots up to its own position, as the per-sequence oracle does."""
    q, _, _, k_cache, v_cache, meta = _build(specs, heads, kv_heads, head_dim, block_size, seed=block_size + heads)
    scale = head_dim**-0.5
    want = torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(_prefill(q, k_cache, v_cache, meta, scale), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("specs", [DECODE_SPECS[2], PREFILL_SPECS[1]])
def test_a_query_view_of_the_qkv_projection_is_read_in_place(specs):
    """q as the engine hands it (a [T, heads, d] view of the fused qkv rows, each row wider than its
    heads) gives bitwise the contiguous copy's result; control: the same memory read as if
    contiguous (a kernel ignoring the row stride) gives another one."""
    heads, kv_heads, d = 9, 3, 64
    q, _, _, k_cache, v_cache, meta = _build(specs, heads, kv_heads, d, 16, seed=7)
    qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * d)
    qkv[:, : heads * d] = q.flatten(1)
    view = qkv[:, : heads * d].view(-1, heads, d)
    assert not view.is_contiguous() and view.stride(0) == qkv.shape[1]
    rows = None if specs is DECODE_SPECS[2] else cpu_kernels.prefill_rows(meta.query_start_loc_cpu, meta.seq_lens_cpu)
    k, v = _head_major(k_cache), _head_major(v_cache)
    want = cpu_kernels.paged_attention(q.contiguous(), k, v, meta.block_tables, meta.seq_lens, d**-0.5, rows)
    got = cpu_kernels.paged_attention(view, k, v, meta.block_tables, meta.seq_lens, d**-0.5, rows)
    assert torch.equal(got, want)
    assert torch.equal(view, qkv[:, : heads * d].view(-1, heads, d)), "q was modified"
    as_if_contiguous = qkv.flatten()[: q.numel()].view_as(q)
    wrong = cpu_kernels.paged_attention(as_if_contiguous, k, v, meta.block_tables, meta.seq_lens, d**-0.5, rows)
    assert not torch.allclose(wrong, want)


def test_negative_control_prefill_rows_that_see_one_slot_too_few_or_start_at_the_top_are_caught():
    """The comparison above fails for rows that see one slot too few, and for a causal mask aligned
    top-left (row j seeing slots 0..j, wrong where the chunk follows cached context)."""
    q, _, _, k_cache, v_cache, meta = _build([(70, 30), (20, 20)], 4, 2, 64, 16, seed=5)
    want = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125)
    row_seq, row_len = cpu_kernels.prefill_rows(meta.query_start_loc_cpu, meta.seq_lens_cpu)
    top_left = torch.cat([torch.arange(1, 31), torch.arange(1, 21)]).to(torch.int32)
    for wrong_len in ((row_len - 1).clamp(min=1), top_left):
        got = _prefill(q, k_cache, v_cache, meta, 0.125, (row_seq, wrong_len))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(row_len[:30], torch.arange(41, 71, dtype=torch.int32))  # bottom-right aligned


def test_a_prefill_row_past_its_sequence_or_naming_none_raises_before_reading():
    kc = torch.zeros(4, 2, 16, 64)
    q = torch.ones(3, 4, 64)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    seq = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(IndexError, match="reaches past its sequence"):
        cpu_kernels.paged_attention(
            q, kc, kc, tables, lens, 0.125, (seq, torch.tensor([18, 19, 21], dtype=torch.int32))
        )
    with pytest.raises(IndexError, match="reaches past its sequence"):
        cpu_kernels.paged_attention(
            q, kc, kc, tables, lens, 0.125, (seq + 1, torch.tensor([18, 19, 20], dtype=torch.int32))
        )
    with pytest.raises(ValueError, match="3 query rows, 2 row lengths"):
        cpu_kernels.paged_attention(q, kc, kc, tables, lens, 0.125, (seq[:2], torch.tensor([1, 2], dtype=torch.int32)))
    # control: in range runs
    cpu_kernels.paged_attention(q, kc, kc, tables, lens, 0.125, (seq, torch.tensor([18, 19, 20], dtype=torch.int32)))


def test_negative_control_a_wrong_length_or_table_is_caught():
    """The comparison above fails for a kernel that reads one slot too few or another sequence's
    blocks: it can tell a wrong kernel from a right one."""
    specs = [(40, 1), (70, 1)]
    q, _, _, k_cache, v_cache, meta = _build(specs, 4, 2, 64, 16, seed=3)
    want = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125)
    hk, hv = _head_major(k_cache), _head_major(v_cache)
    short = cpu_kernels.paged_decode(q, hk, hv, meta.block_tables, meta.seq_lens - 1, 0.125)
    swapped = cpu_kernels.paged_decode(q, hk, hv, meta.block_tables.flip(0), meta.seq_lens, 0.125)
    for wrong in (short, swapped):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(wrong, want, atol=2e-6, rtol=1e-5)


def test_decode_kernel_row_does_not_depend_on_batch_mates_or_threads():
    """A sequence's result is bitwise the same alone, among other sequences, and on 1 or 2 threads."""
    needle = (150, 1)
    q, _, _, k_cache, v_cache, meta = _build([needle], 9, 3, 64, 16, seed=7)
    alone = _decode(q, k_cache, v_cache, meta, 0.125)[0]
    for mates in ([(380, 1)], [(1, 1), (16, 1), (300, 1)], [(5, 1)] * 7):
        specs = mates[:1] + [needle] + mates[1:]
        qb, _, _, kb, vb, mb = _build(specs, 9, 3, 64, 16, seed=8)
        qb[1] = q[0]
        for p in range(needle[0]):  # the needle's K/V into its blocks of the batch's cache
            b, o = p // 16, p % 16
            kb[mb.block_tables[1, b], o] = k_cache[meta.block_tables[0, b], o]
            vb[mb.block_tables[1, b], o] = v_cache[meta.block_tables[0, b], o]
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(_decode(qb, kb, vb, mb, 0.125)[1], alone), f"differs among {mates}, {n} threads"
        finally:
            torch.set_num_threads(threads)


def test_store_kv_kernel_writes_what_the_oracle_writes():
    """Each token's K/V land where ``torch_ref.store_kv(head_major=True)`` puts them, bitwise; slot -1
    writes nothing; keys and values may be row-strided views of the fused qkv projection."""
    g = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, block_size, head_dim, tokens = 6, 3, 16, 64, 40
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=g)
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::7] = -1
    _store_and_compare(k, v, slots, num_blocks, kv_heads, block_size, head_dim)
    # keys and values with different row strides (a contiguous value beside a strided key)
    _store_and_compare(k, v.contiguous(), slots, num_blocks, kv_heads, block_size, head_dim)


def _store_and_compare(k, v, slots, num_blocks, kv_heads, block_size, head_dim):
    caches = {}
    for name, write in (("oracle", None), ("kernel", cpu_kernels.store_kv)):
        kc = torch.full((num_blocks, kv_heads, block_size, head_dim), 7.0)
        vc = torch.full_like(kc, 7.0)
        if write is None:
            torch_ref.store_kv(k, v, kc, vc, slots, head_major=True)
        else:
            write(k, v, kc, vc, slots)
        caches[name] = (kc, vc)
    assert torch.equal(caches["kernel"][0], caches["oracle"][0])
    assert torch.equal(caches["kernel"][1], caches["oracle"][1])
    assert (caches["kernel"][0] == 7.0).sum() == (num_blocks * block_size - (slots >= 0).sum()) * kv_heads * head_dim
    # control: a shifted slot mapping writes elsewhere, and the comparison sees it
    kc, vc = torch.full_like(caches["oracle"][0], 7.0), torch.full_like(caches["oracle"][1], 7.0)
    cpu_kernels.store_kv(k, v, kc, vc, torch.where(slots >= 0, (slots + 1) % (num_blocks * block_size), slots))
    assert not torch.equal(kc, caches["oracle"][0])


def test_the_backend_takes_the_kernels_for_float32_and_pytorch_otherwise(monkeypatch):
    """float32 decode goes through the kernel; a bfloat16 cache and NANOVLLM_CPU_KERNELS=0 take the
    PyTorch path (spied), with the same results."""
    q, _, _, k_cache, v_cache, meta = _build([(40, 1), (9, 1)], 4, 2, 64, 16, seed=2)
    hk, hv = _head_major(k_cache), _head_major(v_cache)
    calls = []
    real = torch_ref.paged_decode_batched
    monkeypatch.setattr(torch_ref, "paged_decode_batched", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = TorchBackend.forward(q, hk, hv, meta, 0.125)
    assert calls == []
    TorchBackend.forward(q.bfloat16(), hk.bfloat16(), hv.bfloat16(), meta, 0.125)
    assert calls == [1]
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        slow = TorchBackend.forward(q, hk, hv, meta, 0.125)
        assert calls == [1, 1]
        torch.testing.assert_close(fast, slow, atol=2e-6, rtol=1e-5)
    finally:
        monkeypatch.delenv(cpu_kernels.SWITCH)
        cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None


def test_a_failed_build_falls_back_and_says_why(monkeypatch, tmp_path, caplog):
    """A compiler that fails (here ``false``) or is absent leaves the PyTorch path, with a warning naming why."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_kernels.load() is None
        assert "could not be built" in caplog.text and "PyTorch" in caplog.text
        q = torch.zeros(1, 4, 64)
        assert not cpu_kernels.applies(q, torch.zeros(2, 2, 16, 64))
    finally:
        monkeypatch.delenv("CC")
        cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None


def test_the_engine_gives_the_same_greedy_tokens_with_and_without_the_kernels(monkeypatch):
    """End to end on a zoo model: the kernels change the order of float32 sums only, which leaves
    this model's greedy tokens as they were."""
    from conformance.zoo import zoo_model
    from nanovllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 9 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.SWITCH, switch)
        cpu_kernels.load.cache_clear()
        llm = LLM(zoo_model("qwen3-gqa2-hd64-tied"), device="cpu", kv_cache_memory_gib=0.02)
        try:
            tokens[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    monkeypatch.delenv(cpu_kernels.SWITCH)
    cpu_kernels.load.cache_clear()
    assert tokens["1"] == tokens["0"]
    assert all(len(t) == 24 for t in tokens["1"])


def test_out_of_range_slots_and_blocks_raise_before_touching_memory():
    """A slot or block id outside the cache is an IndexError naming it, raised before the kernel
    reads or writes anything (the PyTorch path raises too; a C kernel must not write past the cache)."""
    kc = torch.zeros(4, 2, 16, 64)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 2, 64)
    with pytest.raises(IndexError, match="slot 64 outside the KV cache's 64 slots"):
        cpu_kernels.store_kv(k, k, kc, vc, torch.tensor([0, 5, 64]))
    assert not kc.any() and not vc.any(), "a token was written before the bad slot was seen"
    q = torch.ones(2, 4, 64)
    tables = torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)
    with pytest.raises(IndexError, match="outside the cache's 4 blocks"):
        cpu_kernels.paged_decode(q, kc, vc, tables, torch.tensor([20, 20], dtype=torch.int32), 0.125)
    with pytest.raises(IndexError, match="exceeds its block table"):
        cpu_kernels.paged_decode(q, kc, vc, tables[:, :1], torch.tensor([20, 3], dtype=torch.int32), 0.125)
    # control: the same calls within range run
    cpu_kernels.store_kv(k, k, kc, vc, torch.tensor([0, 5, 63]))
    assert kc.any()
    cpu_kernels.paged_decode(q, kc, vc, tables.clamp(max=3), torch.tensor([20, 20], dtype=torch.int32), 0.125)


def test_called_directly_the_kernels_refuse_what_they_cannot_read():
    """The kernels read raw float32 memory: a bfloat16 cache or query is a ValueError naming the dtypes,
    never a misread."""
    kc = torch.zeros(4, 2, 16, 64)
    q = torch.ones(1, 4, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.paged_decode(q, kc.bfloat16(), kc.bfloat16(), tables, lens, 0.125)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.store_kv(q[:, :2].bfloat16(), q[:, :2].bfloat16(), kc, kc.clone(), torch.zeros(1))
    cpu_kernels.paged_decode(q, kc, kc, tables, lens, 0.125)  # control: float32 runs


RMS_SHAPES = [(1, 576), (32, 576), (3, 17), (5, 600), (300, 960), (2, 4096), (4, 16384), (2100, 576)]


@pytest.mark.parametrize("rows,n", RMS_SHAPES)
def test_rms_norm_kernel_is_torchs_rms_norm_bitwise(rows, n):
    """The C RMSNorm (and its residual add) gives F.rms_norm's floats bitwise: a decode batch, a
    scalar tail, the cascade's levels (16,384 floats), a prefill chunk on both threads; x and the
    residual with row strides of their own (views) are read in place; the inputs are left as they were."""
    import torch.nn.functional as F

    assert cpu_kernels.rms_norm_lanes() is not None, "the C RMSNorm was refused on this machine's torch"
    g = torch.Generator().manual_seed(rows + n)
    wide = torch.randn(rows, n + 7, generator=g) * 4
    x, w = wide[:, :n], torch.randn(n, generator=g)
    r = torch.randn(rows, n + 3, generator=g)[:, 3:]  # its own row stride too
    kept = (x.clone(), r.clone())
    assert torch.equal(cpu_kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), w, 1e-6))
    out, summed = cpu_kernels.rms_norm(x, w, 1e-5, r)
    assert torch.equal(summed, x + r) and torch.equal(out, F.rms_norm(x + r, (n,), w, 1e-5))
    assert torch.equal(x, kept[0]) and torch.equal(r, kept[1])


def test_negative_control_the_rms_norm_check_tells_an_order_apart():
    """The other vector width (another order of the same sums) differs from torch in the last bit on
    the probe rows, so the bitwise comparison above and the lane probe can fail."""
    import torch.nn.functional as F

    lanes = cpu_kernels.rms_norm_lanes()
    other = 16 if lanes == 8 else 8
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 576, generator=g) * 3, torch.randn(576, generator=g)
    wrong = cpu_kernels._rms_norm_call(cpu_kernels.load(), x, w, 1e-6, None, other)
    assert not torch.equal(wrong, F.rms_norm(x, (576,), w, 1e-6))
    assert torch.allclose(wrong, F.rms_norm(x, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)  # the same norm otherwise


def test_rms_norm_takes_the_kernel_only_where_it_applies():
    w = torch.ones(8 * 16)
    x = torch.randn(4, 8 * 16)
    assert cpu_kernels.rms_norm_applies(x, w, None) and cpu_kernels.rms_norm_applies(x, w, x)
    assert not cpu_kernels.rms_norm_applies(x.double(), w.double(), None)  # float32 only
    assert not cpu_kernels.rms_norm_applies(x.view(4, 8, 16), w[:16], None)  # rows, not heads
    assert not cpu_kernels.rms_norm_applies(x.t(), torch.ones(4), None)  # a strided last dimension
    assert not cpu_kernels.rms_norm_applies(x, w[:64], None)  # a weight of another size


SILU_SHAPES = [(1, 1536), (32, 1536), (31, 1536), (4, 100), (3, 600), (3, 11008), (41, 1000), (1024, 1536), (5, 7)]


@pytest.mark.parametrize("rows,n", SILU_SHAPES)
def test_silu_and_mul_kernel_is_torchs_bitwise(rows, n):
    """The C SiLU-and-multiply gives F.silu(gate) * up's floats bitwise: decode rows, scalar tails,
    torch's threads' pieces cut mid-row, a prefill tile, a row shorter than one vector block; the
    merged projection is read in place and left as it was."""
    import torch.nn.functional as F

    assert cpu_kernels.silu_lanes() is not None, "the C SiLU was refused on this machine's torch"
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(rows * n)) * 4
    kept = x.clone()
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(cpu_kernels.silu_and_mul(x), F.silu(gate) * up)
    assert torch.equal(x, kept)


def test_negative_control_the_silu_check_tells_torchs_exp_from_libms():
    """Every float through libm's e^x (lanes=1: no vector blocks) differs from torch in the last bit
    somewhere in a prefill tile, so the comparison above and the lane probe can fail."""
    import torch.nn.functional as F

    x = torch.randn(1024, 3072, generator=torch.Generator().manual_seed(5)) * 4
    gate, up = x.chunk(2, dim=-1)
    scalar = cpu_kernels._silu_call(cpu_kernels.load(), x, 1)
    want = F.silu(gate) * up
    assert not torch.equal(scalar, want) and torch.allclose(scalar, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_silu_and_rms_norm_kernels_follow_torchs_threads(threads):
    """torch's SiLU cuts its floats into one piece per thread (its pieces decide which floats take
    the vector e^x): with 1, 2, 3 or 5 threads the C kernels still give torch's floats bitwise. Sizes
    that the pieces do not divide (3 x 11,001 in 2 pieces, 7 x 9,973 in 2 or 3) leave a last piece
    shorter than the others, which must still be written."""
    import torch.nn.functional as F

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        uneven = ((3, 11001), (7, 9973))
        if threads > 1:  # the sizes do what the docstring says
            assert all(rows * n % cpu_kernels._torch_pieces(rows * n) for rows, n in uneven)
        for rows, n in ((300, 600), (41, 1000), (2100, 576), *uneven):
            x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 4
            gate, up = x.chunk(2, dim=-1)
            assert torch.equal(cpu_kernels.silu_and_mul(x), F.silu(gate) * up), (threads, rows, n)
            w = torch.randn(n)
            assert torch.equal(cpu_kernels.rms_norm(gate, w, 1e-6), F.rms_norm(gate, (n,), w, 1e-6))
    finally:
        torch.set_num_threads(before)


def test_silu_takes_the_kernel_only_where_it_applies():
    x = torch.randn(4, 64)
    assert cpu_kernels.silu_applies(x)
    assert not cpu_kernels.silu_applies(x.double())  # float32 only
    assert not cpu_kernels.silu_applies(x[:, :63])  # no even split into gate and up
    assert not cpu_kernels.silu_applies(x.t())  # a strided last dimension
    assert not cpu_kernels.silu_applies(x.view(4, 4, 16))  # rows only


def test_rms_norm_and_silu_kernels_return_float32_whatever_torchs_default_dtype():
    """The kernels write float32: their outputs are float32 tensors even where a caller changed
    torch's default dtype, and still torch's results."""
    import torch.nn.functional as F

    x = torch.randn(4, 64)
    w = torch.randn(32)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        normed = cpu_kernels.rms_norm(x[:, :32], w, 1e-6, x[:, 32:])
        silu = cpu_kernels.silu_and_mul(x)
    finally:
        torch.set_default_dtype(before)
    assert normed[0].dtype == normed[1].dtype == silu.dtype == torch.float32
    assert torch.equal(normed[0], F.rms_norm(x[:, :32] + x[:, 32:], (32,), w, 1e-6))
    assert torch.equal(silu, F.silu(x[:, :32]) * x[:, 32:])


def _left_out_of_the_wheel(files, globs) -> list[str]:
    import fnmatch

    return [f.name for f in files if not any(fnmatch.fnmatch(f.name, g) for g in globs)]


def test_the_wheel_carries_every_file_the_kernel_build_reads():
    """pyproject's package data for nanovllm.cpu_kernels matches every source and header the build
    compiles (``cpu_kernels.SOURCES`` and ``HEADERS``): a file left out makes an installed nanovllm
    fail its build and run the slow PyTorch path (vec_exp.h was, until 2026-12-05). The wheel itself
    is built and its kernels compiled by .ci/installed-suite. Control: the old globs, "*.c" only."""
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["nanovllm.cpu_kernels"]
    files = cpu_kernels.SOURCES + cpu_kernels.HEADERS
    assert not _left_out_of_the_wheel(files, globs)
    assert _left_out_of_the_wheel(files, ["*.c"]) == [h.name for h in cpu_kernels.HEADERS]
