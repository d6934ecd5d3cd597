"""The CPU fast paths: exact where they claim to be, independent of batch-mates, caches that never go stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm import cpu_kernels
from nanovllm.attention import torch_ref
from nanovllm.layers import cpu_linear
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ColumnParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from tests.test_attention_ref import _build


def _decode_row(specs, row, seed):
    q, _, _, k_cache, v_cache, meta = _build(specs, 8, 2, 64, 16, seed=seed)
    return torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, 0.125)[row]


def test_decode_row_does_not_depend_on_batch_mates():
    """A sequence's decode output is bitwise the same alone and among longer and shorter sequences
    (its blocks only: no padding to the longest sequence enters its sums)."""
    needle = (37, 1)
    q, _, _, k_cache, v_cache, meta = _build([needle], 8, 2, 64, 16, seed=1)
    alone = torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, 0.125)[0]
    for mates in ([(300, 1)], [(1, 1), (16, 1), (300, 1)], [(5, 1)] * 7):
        specs = mates[:1] + [needle] + mates[1:]
        qb, _, _, kb, vb, mb = _build(specs, 8, 2, 64, 16, seed=1)
        # the same needle data in another cache layout: write its q/k/v from the solo build
        got = _same_needle_in_batch(specs, 1, (q, k_cache, v_cache, meta), (qb, kb, vb, mb))
        assert torch.equal(got, alone), f"needle differs among {mates}"


def _same_needle_in_batch(specs, pos, solo, batch):
    q, k_cache, v_cache, meta = solo
    qb, kb, vb, mb = batch
    qb[pos] = q[0]
    n = meta.seq_lens_cpu[0]
    for src, dst in ((k_cache, kb), (v_cache, vb)):
        for p in range(n):
            b, o = p // 16, p % 16
            dst[mb.block_tables[pos, b], o] = src[meta.block_tables[0, b], o]
    return torch_ref.paged_decode_batched(qb, kb, vb, mb, 0.125)[pos]


def test_decode_plan_is_rebuilt_for_each_step():
    """The per-step block plan is cached for the layers of one step; a new step's metadata (other
    lengths) must get its own plan: alternating two steps equals the per-sequence oracle each time."""
    a = _build([(20, 1), (3, 1)], 8, 2, 64, 16, seed=4)
    b = _build([(50, 1), (70, 1), (1, 1)], 8, 2, 64, 16, seed=5)
    for q, _, _, k_cache, v_cache, meta in (a, b, a, b):
        want = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125)
        got = torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, 0.125)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # control: a plan of another step, forced in, gives wrong rows
    q, _, _, k_cache, v_cache, meta = b
    torch_ref.paged_decode_batched(a[0], a[3], a[4], a[5], 0.125)
    torch_ref._plan_cache[0] = meta  # pretend a's plan belongs to b's step
    stale = torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, 0.125)
    torch_ref._plan_cache.clear()
    assert not torch.allclose(stale, torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125), equal_nan=True)


@pytest.fixture(params=["pytorch", "c"])
def cpu_path(request, monkeypatch):
    """The CPU layers twice: their PyTorch code (NANOVLLM_CPU_KERNELS=0) and the compiled kernels."""
    if request.param == "c" and cpu_kernels.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C compiler; see the log)")
    monkeypatch.setenv(cpu_kernels.SWITCH, "1" if request.param == "c" else "0")
    cpu_kernels.load.cache_clear()
    yield request.param
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_hf_formula_bitwise(dtype, cpu_path):
    """Both paths, bitwise (the C kernel rotates in place; float32 only, bfloat16 stays in PyTorch)."""
    rope = RotaryEmbedding(64, 256, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 3 * 4 * 64, generator=g).to(dtype)  # q, k as strided views of one matrix
    q, k = qkv[:, : 2 * 64].view(9, 2, 64), qkv[:, 2 * 64 : 3 * 64].view(9, 1, 64)

    def rotated(positions):
        fresh = qkv.clone()  # the kernel rotates in place: each call on a fresh copy of the views
        return rope(positions, fresh[:, : 2 * 64].view(9, 2, 64), fresh[:, 2 * 64 : 3 * 64].view(9, 1, 64))

    for positions in (torch.arange(9), torch.tensor([200, 3, 7, 7, 0, 255, 1, 2, 100])):
        cos, sin = rope.cos[positions].unsqueeze(1).to(dtype), rope.sin[positions].unsqueeze(1).to(dtype)
        want_q = q * cos + RotaryEmbedding._rotate_half(q) * sin  # transformers' apply_rotary_pos_emb
        want_k = k * cos + RotaryEmbedding._rotate_half(k) * sin
        got_q, got_k = rotated(positions)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        # the second layer of the step (same positions tensor) reuses the tables, same result
        again_q, _ = rotated(positions)
        assert torch.equal(again_q, want_q)
    # control: the half-split rotation is not the identity, and swapping the halves' signs is caught
    assert not torch.equal(got_q, q)
    assert not torch.equal(got_q, q * cos - RotaryEmbedding._rotate_half(q) * sin)
    if cpu_path == "c" and dtype == torch.float32:
        with pytest.raises(IndexError, match="outside the 256-row tables"):
            rotated(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 256]))


def test_rope_tables_follow_new_positions_with_same_values_elsewhere(cpu_path):
    """A new positions tensor (next step) recomputes the tables even when an old one is cached."""
    rope = RotaryEmbedding(32, 64, 10000.0)
    q, k = torch.randn(4, 1, 32), torch.randn(4, 1, 32)
    first = rope(torch.tensor([0, 1, 2, 3]), q.clone(), k.clone())[0]
    second = rope(torch.tensor([10, 11, 12, 13]), q.clone(), k.clone())[0]
    fresh = RotaryEmbedding(32, 64, 10000.0)(torch.tensor([10, 11, 12, 13]), q.clone(), k.clone())[0]
    assert torch.equal(second, fresh) and not torch.equal(first, second)


def test_rmsnorm_and_silu_equal_hf_formulas_and_leave_inputs(cpu_path):
    """Bitwise transformers' formulas with the CPU kernels on or off (RMSNorm and SiLU stay in
    PyTorch: a C version's last-bit differences moved a greedy token of the FP8 golden test); the
    inputs are left as they were."""
    for rows, width in ((300, 600), (1, 576), (2100, 576)):
        # 600 = 37 x 16 + 8: a masked tail; 300 x 600 > one thread's share; a decode row; a prefill chunk
        _check_rmsnorm_and_silu(rows, width)


def _check_rmsnorm_and_silu(rows: int, width: int) -> None:
    norm = RMSNorm(width, 1e-6)
    norm.weight.data = torch.randn(width)
    x, r = torch.randn(rows, width), torch.randn(rows, width)
    x0, r0 = x.clone(), r.clone()

    def hf(h):
        return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    same = torch.equal

    got, res = norm(x, r)
    assert same(norm(x), hf(x)) and same(got, hf(x + r)) and torch.equal(res, x + r)
    assert torch.equal(x, x0) and torch.equal(r, r0), "an input was modified in place"
    gate_up = torch.randn(rows, 2 * width) * 4
    kept = gate_up.clone()
    want = F.silu(kept[:, :width]) * kept[:, width:]
    assert same(SiluAndMul()(gate_up), want)
    assert torch.equal(gate_up, kept)
    # controls: a wrong eps, a missing weight or a plain product are told apart
    assert not same(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)))
    assert not same(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert not same(SiluAndMul()(gate_up), torch.sigmoid(kept[:, :width]) * kept[:, width:])
    if rows > 1:  # and a last-bit difference: the mean of squares summed in float64 instead
        mean64 = x.double().pow(2).mean(-1, keepdim=True).float()
        assert not same(norm(x), norm.weight * (x * torch.rsqrt(mean64 + 1e-6)))


@pytest.mark.skipif(
    torch.bfloat16 not in cpu_linear.packable_dtypes(), reason="this CPU's oneDNN has no native bfloat16"
)
def test_bfloat16_linear_is_packed_and_matches_f_linear():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 96).to(torch.bfloat16)
    layer.weight.data.normal_()
    assert cpu_linear.pack_linear_weights(layer) == 1 and layer.packed_weight is not None
    assert layer.packed_weight.dtype == torch.bfloat16
    x = torch.randn(7, 64).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float())
    torch.testing.assert_close(layer(x).float(), want, atol=0.3, rtol=2e-2)
    # control: the packed copy is what multiplies (a packed copy of other weights gives other outputs)
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(-layer.weight.detach(), cpu_linear.PACK_BATCH_HINT)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(layer(x).float(), want, atol=0.3, rtol=2e-2)


@pytest.mark.skipif(
    torch.bfloat16 not in cpu_linear.packable_dtypes(), reason="this CPU's oneDNN has no native bfloat16"
)
def test_bfloat16_engine_packed_gives_the_tokens_of_f_linear(monkeypatch):
    """The opt-in bfloat16 CPU engine with packed bfloat16 weights gives the greedy tokens of the
    same engine on F.linear (the path before packing), on a zoo model."""
    from conformance.zoo import ZOO, zoo_model
    from nanovllm import LLM, SamplingParams
    from tests.conftest import prompts_for, token_ids

    path = zoo_model("llama-mha-hd64")
    prompts = prompts_for(ZOO["llama-mha-hd64"].vocab_size, (1, 15, 17, 48, 83))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(cpu_linear, "packable_dtypes", lambda: (torch.float32,))
        llm = LLM(path, device="cpu", dtype="bfloat16", block_size=16, seed=0)
        try:
            layer = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
            assert (layer.packed_weight is not None) == packed
            runs[packed] = token_ids(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.close()
    assert runs[True] == runs[False]


def test_a_long_prefill_mlp_runs_in_row_tiles_with_the_untiled_result_bitwise(monkeypatch):
    """Over 2 x MLP_ROW_TILE rows, the CPU MLP runs gate_up / SiLU / down per tile of rows (cache-sized
    pieces): the same floats as one piece (oneDNN's rows are independent), every row once, in order."""
    from types import SimpleNamespace

    from nanovllm.models.llama import LlamaMLP

    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(config, bias=False)
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    cpu_linear.pack_linear_weights(mlp)
    monkeypatch.setattr(cpu_linear, "MLP_ROW_TILE", 16)
    x = torch.randn(70, 64)
    calls = []
    real = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda t: calls.append(t.shape[0]) or real(t))
    tiled = mlp(x)
    assert calls == [16, 16, 16, 16, 6]
    assert cpu_linear.mlp_row_tile(x[:32]) is None  # up to two tiles: one piece
    monkeypatch.setattr(cpu_linear, "MLP_ROW_TILE", 10**9)
    whole = mlp(x)
    assert calls[-1] == 70
    assert torch.equal(tiled, whole)
    assert not torch.equal(tiled, torch.cat([whole[16:], whole[:16]]))  # control: order matters
