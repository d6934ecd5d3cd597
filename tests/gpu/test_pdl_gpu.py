"""Programmatic dependent launch on the GPU: a chain of the decode step's kernels (RMSNorm with
the residual, a cuBLAS product, Qwen3's q/k norm + RoPE, the K/V store, split decode attention and
its merge, SiLU*mul, the sampler), twelve layers deep, captured in a CUDA graph with PDL on and
replayed on fresh inputs, gives bit for bit what the same chain gives eagerly with PDL off. A
kernel that read its predecessor's output before that was written would differ (the inputs change
at every replay, so stale values cannot match by chance)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs compute capability >= 9.0", allow_module_level=True)

from nanovllm.attention import triton_ops  # noqa: E402
from nanovllm.layers import fused_ops, fused_sampler, pdl  # noqa: E402

T, HQ, HK, D, H, INTER, V, LAYERS = 48, 16, 8, 128, 1024, 3072, 32_000, 12
BLOCK, BLOCKS_PER_SEQ = 256, 8


def _weights(g):
    def w(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    return dict(
        qkv=w((HQ + 2 * HK) * D, H), o=w(H, HQ * D), gate_up=w(2 * INTER, H), down=w(H, INTER), head=w(V, H),
        norm=torch.ones(H, device="cuda", dtype=torch.bfloat16), qk=torch.ones(D, device="cuda", dtype=torch.bfloat16),
    )  # fmt: skip


def _chain(x, positions, slots, tables, lens, caches, cos, sin, w):
    residual = torch.zeros_like(x)
    for k_cache, v_cache in caches:
        h, residual = fused_ops.rms_norm(x, w["norm"], 1e-6, residual)
        qkv = h @ w["qkv"].T
        q, k = fused_ops.qk_norm_rope(positions, qkv, HQ, HK, (w["qk"], 1e-6), (w["qk"], 1e-6), cos, sin)
        v = qkv[:, (HQ + HK) * D :].view(T, HK, D)
        triton_ops.store_kv(k, v, k_cache, v_cache, slots)
        o = triton_ops.paged_decode(q, k_cache, v_cache, tables, lens, D**-0.5, num_splits=2)
        h, residual = fused_ops.rms_norm(o.flatten(1) @ w["o"].T, w["norm"], 1e-6, residual)
        x = fused_ops.silu_and_mul(h @ w["gate_up"].T) @ w["down"].T
    logits = fused_ops.rms_norm(x, w["norm"], 1e-6, residual)[0] @ w["head"].T
    tokens, _ = fused_sampler.sample(logits, torch.ones(T, device="cuda"), torch.arange(T, device="cuda"))
    return x, logits, tokens


CHAIN_KERNELS = [
    fused_ops._rms_norm_kernel, fused_ops._qk_norm_rope_kernel, fused_ops._silu_mul_kernel,
    triton_ops._store_kv_kernel, triton_ops._decode_kernel, triton_ops._merge_kernel,
    fused_sampler._sample_kernel, fused_sampler._sample_merge_kernel,
]  # fmt: skip


def _launch_pdl_variants(kernel) -> set[bool]:
    """``launch_pdl`` of every variant of ``kernel`` compiled so far in this process."""
    return {k.metadata.launch_pdl for cache in kernel.device_caches.values() for k in cache[0].values()}


def test_a_graph_with_pdl_equals_the_eager_chain_without_it(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = _weights(g)
    cos, sin = torch.randn(4096, D, device="cuda", generator=g), torch.randn(4096, D, device="cuda", generator=g)
    tables = torch.arange(T * BLOCKS_PER_SEQ, device="cuda", dtype=torch.int32).view(T, BLOCKS_PER_SEQ)
    lens = torch.randint(1, BLOCK * BLOCKS_PER_SEQ, (T,), device="cuda", generator=g, dtype=torch.int32)
    positions = (lens - 1).long()
    slots = tables.gather(1, (positions // BLOCK).view(T, 1)).view(T).long() * BLOCK + positions % BLOCK

    def fresh_caches():
        shape = (T * BLOCKS_PER_SEQ, BLOCK, HK, D)
        return [
            (torch.randn(shape, device="cuda", generator=g).bfloat16(), torch.randn(shape, device="cuda", generator=g).bfloat16())
            for _ in range(LAYERS)
        ]  # fmt: skip

    static_x = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    static_caches = fresh_caches()
    monkeypatch.setenv("NANOVLLM_PDL", "1")
    assert pdl.enabled(static_x)
    _chain(static_x.normal_(), positions, slots, tables, lens, static_caches, cos, sin, w)  # compile, warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(static_x, positions, slots, tables, lens, static_caches, cos, sin, w)
    # the launches really carried the attribute (not only the kernels' wait)
    missing = [k.fn.__name__ for k in CHAIN_KERNELS if True not in _launch_pdl_variants(k)]
    assert not missing, f"compiled without launch_pdl: {missing}"

    for replay in range(5):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        caches = fresh_caches()
        static_x.copy_(x)
        for (k, v), (k2, v2) in zip(static_caches, caches):
            k.copy_(k2)
            v.copy_(v2)
        graph.replay()
        monkeypatch.setenv("NANOVLLM_PDL", "0")
        want = _chain(x, positions, slots, tables, lens, caches, cos, sin, w)
        monkeypatch.setenv("NANOVLLM_PDL", "1")
        torch.cuda.synchronize()
        for name, got, ref in zip(("hidden", "logits", "tokens"), outs, want):
            assert torch.equal(got, ref), f"replay {replay}: {name} differs with PDL"
        for (k, v), (k2, v2) in zip(static_caches, caches):
            assert torch.equal(k, k2) and torch.equal(v, v2), f"replay {replay}: the K/V store differs with PDL"
        # the rule is not vacuous: one changed logit is seen
        bad = want[1].clone()
        bad[0, 0] += 1
        assert not torch.equal(outs[1], bad)
