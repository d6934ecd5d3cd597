"""Fused RMSNorm / SiLU*mul / RoPE kernels against the PyTorch layers they replace.

On a GPU (marker ``gpu``) in bfloat16 and float32; under Triton's CPU interpreter
(NANOVLLM_TRITON_INTERPRET=1 TRITON_INTERPRET=1, run by test_triton_interpret.py)
in float32 and float16. Outputs are compared within one rounding of the dtype.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16]
fused_ops = pytest.importorskip("nanovllm.layers.fused_ops", reason="needs triton")
if fused_ops.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _ref_rms(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w * y, x) if residual is not None else w * y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 576), (33, 1024), (5, 128)])
def test_rms_norm(dtype, rows, cols):
    g = torch.Generator(device=DEVICE).manual_seed(rows * cols)
    x = torch.randn(rows, cols, device=DEVICE, generator=g).to(dtype)
    r = torch.randn(rows, cols, device=DEVICE, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device=DEVICE, generator=g)).to(dtype)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), _ref_rms(x, w, 1e-6), atol=_tol(dtype), rtol=_tol(dtype))
    out, res = fused_ops.rms_norm(x, w, 1e-6, residual=r)
    want_out, want_res = _ref_rms(x, w, 1e-6, residual=r)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # the rounded sum, exactly
    torch.testing.assert_close(out, want_out, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """Qwen3's q/k norm: [T, heads, d] rows of a wider buffer."""
    buf = torch.randn(9, 5 * 64, device=DEVICE).to(dtype)
    q = buf[:, : 4 * 64].view(9, 4, 64)
    w = torch.rand(64, device=DEVICE).to(dtype)
    torch.testing.assert_close(fused_ops.rms_norm(q, w, 1e-6), _ref_rms(q, w, 1e-6), atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (6, 1536), (17, 3072)])
def test_silu_and_mul(dtype, rows, n):
    x = torch.randn(rows, 2 * n, device=DEVICE).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), F.silu(gate) * up, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_rotary_in_place_on_qkv_views(dtype, d):
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    t, hq, hk = 11, 4, 2
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEVICE).to(dtype)
    pos = torch.randint(0, 512, (t,), device=DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    cos, sin = rope.cos[pos].unsqueeze(1).to(dtype), rope.sin[pos].unsqueeze(1).to(dtype)
    want_q = q * cos + RotaryEmbedding._rotate_half(q) * sin
    want_k = k * cos + RotaryEmbedding._rotate_half(k) * sin
    fused_ops.rotary_(pos, q, k, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, atol=2 * _tol(dtype), rtol=2 * _tol(dtype))
    torch.testing.assert_close(k, want_k, atol=2 * _tol(dtype), rtol=2 * _tol(dtype))
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "rotary wrote into v"


def _qk_case(dtype, t=13, hq=4, hk=2, d=64, seed=0):
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    qkv = (3 * torch.randn(t, (hq + 2 * hk) * d, device=DEVICE, generator=g)).to(dtype)
    pos = torch.randint(0, 500, (t,), device=DEVICE, generator=g)  # room for the control's pos + 1
    q_w = (1 + 0.2 * torch.randn(d, device=DEVICE, generator=g)).to(dtype)
    k_w = (1 + 0.2 * torch.randn(d, device=DEVICE, generator=g)).to(dtype)
    return rope, qkv, pos, q_w, k_w


def _qk_reference(rope, qkv, pos, q_w, k_w, hq, hk, d, eps):
    """Qwen3's PyTorch path: per-head RMSNorm (HF's roundings), then RoPE."""
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    t = qkv.shape[0]
    q = _ref_rms(qkv[:, : hq * d].view(t, hq, d), q_w, eps)
    k = _ref_rms(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), k_w, eps)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    rot = lambda x: (x.float() * cos + RotaryEmbedding._rotate_half(x.float()) * sin).to(x.dtype)  # noqa: E731
    return rot(q), rot(k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(13, 4, 2, 64), (1, 16, 8, 128), (5, 2, 2, 128), (3, 32, 8, 64)])
def test_qk_norm_rope_equals_norm_then_rope(dtype, t, hq, hk, d):
    """The fused kernel against the PyTorch reference and against the three unfused kernels; v is
    untouched and q/k come out contiguous."""
    rope, qkv, pos, q_w, k_w = _qk_case(dtype, t, hq, hk, d, seed=t * d)
    before = qkv.clone()
    q, k = fused_ops.qk_norm_rope(pos, qkv, hq, hk, (q_w, 1e-6), (k_w, 1e-5), rope.cos, rope.sin)
    assert torch.equal(qkv, before), "the fused kernel wrote into qkv"
    assert q.shape == (t, hq, d) and k.shape == (t, hk, d) and q.is_contiguous() and k.is_contiguous()
    want_q, want_k = _qk_reference(rope, qkv, pos, q_w, k_w, hq, hk, d, 1e-6)
    _, want_k = _qk_reference(rope, qkv, pos, q_w, k_w, hq, hk, d, 1e-5)
    tol = 2 * _tol(dtype)
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)
    uq = fused_ops.rms_norm(qkv[:, : hq * d].view(t, hq, d), q_w, 1e-6)
    uk = fused_ops.rms_norm(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), k_w, 1e-5)
    fused_ops.rotary_(pos, uq, uk, rope.cos, rope.sin)
    torch.testing.assert_close(q, uq, atol=tol, rtol=tol)
    torch.testing.assert_close(k, uk, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_comparison_rejects_swapped_weights_and_positions(dtype):
    """Negative controls for the rule above: q's and k's norm weights exchanged, or every position
    one further, each fails the comparison."""
    t, hq, hk, d = 9, 4, 2, 64
    rope, qkv, pos, q_w, k_w = _qk_case(dtype, t, hq, hk, d, seed=7)
    want_q, want_k = _qk_reference(rope, qkv, pos, q_w, k_w, hq, hk, d, 1e-6)
    tol = 2 * _tol(dtype)
    q, k = fused_ops.qk_norm_rope(pos, qkv, hq, hk, (k_w, 1e-6), (q_w, 1e-6), rope.cos, rope.sin)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    q, k = fused_ops.qk_norm_rope(pos + 1, qkv, hq, hk, (q_w, 1e-6), (k_w, 1e-6), rope.cos, rope.sin)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)


def test_qk_norm_rope_refuses_a_qkv_of_the_wrong_width():
    rope, qkv, pos, q_w, k_w = _qk_case(torch.float32)
    with pytest.raises(ValueError, match="qkv"):
        fused_ops.qk_norm_rope(pos, qkv[:, :-64], 4, 2, (q_w, 1e-6), (k_w, 1e-6), rope.cos, rope.sin)


def _cache_case(dtype, t, hk, d, block_size=16, num_blocks=6, seed=0):
    """Head-major caches as the Triton backend makes them, filled with a sentinel, and slots for
    t tokens: distinct, scattered over the blocks but the last slot, every third -1 (a CUDA-graph
    padding row)."""
    from nanovllm.attention.triton_backend import TritonBackend

    g = torch.Generator().manual_seed(seed)
    caches = [TritonBackend.new_kv_cache(num_blocks, block_size, hk, d, dtype, DEVICE) for _ in range(2)]
    for c in caches:
        c.fill_(-7.0)
    slots = torch.randperm(num_blocks * block_size - 1, generator=g)[
        :t
    ]  # the last slot free: slots + 1 stay in the cache
    slots[::3] = -1
    return caches, slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(13, 4, 2, 64), (7, 16, 8, 128), (5, 2, 2, 128)])
def test_qk_norm_rope_writes_the_cache_as_the_store_kernel_does(dtype, t, hq, hk, d):
    """With a CacheWrite the kernel puts k and v where ``triton_ops.store_kv`` would (bitwise, every
    slot of both caches: -1 slots and the others untouched) and q is unchanged."""
    from nanovllm.attention import triton_ops

    rope, qkv, pos, q_w, k_w = _qk_case(dtype, t, hq, hk, d, seed=t + d)
    (want_kc, want_vc), slots = _cache_case(dtype, t, hk, d, seed=t)
    (kc, vc), _ = _cache_case(dtype, t, hk, d, seed=t)
    norms = ((q_w, 1e-6), (k_w, 1e-5))
    want_q, k = fused_ops.qk_norm_rope(pos, qkv, hq, hk, *norms, rope.cos, rope.sin)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    triton_ops.store_kv(k, v, want_kc, want_vc, slots)
    q, none = fused_ops.qk_norm_rope(
        pos, qkv, hq, hk, *norms, rope.cos, rope.sin, cache=fused_ops.CacheWrite(kc, vc, slots)
    )
    assert none is None
    assert torch.equal(q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert (want_kc != -7.0).any() and (want_vc != -7.0).any(), "the reference wrote nothing: a vacuous check"


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_cache_comparison_rejects_shifted_slots_and_swapped_caches(dtype):
    """Negative controls for the rule above: slots one further, or k's and v's caches exchanged,
    each makes the caches differ from the store kernel's."""
    from nanovllm.attention import triton_ops

    t, hq, hk, d = 9, 4, 2, 64
    rope, qkv, pos, q_w, k_w = _qk_case(dtype, t, hq, hk, d, seed=3)
    (want_kc, want_vc), slots = _cache_case(dtype, t, hk, d)
    norms = ((q_w, 1e-6), (k_w, 1e-6))
    _, k = fused_ops.qk_norm_rope(pos, qkv, hq, hk, *norms, rope.cos, rope.sin)
    triton_ops.store_kv(k, qkv[:, (hq + hk) * d :].view(t, hk, d), want_kc, want_vc, slots)
    shifted = torch.where(slots >= 0, slots + 1, slots)
    for write in (lambda c: fused_ops.CacheWrite(*c, shifted), lambda c: fused_ops.CacheWrite(c[1], c[0], slots)):
        caches, _ = _cache_case(dtype, t, hk, d)
        fused_ops.qk_norm_rope(pos, qkv, hq, hk, *norms, rope.cos, rope.sin, cache=write(caches))
        assert not (torch.equal(caches[0], want_kc) and torch.equal(caches[1], want_vc))


def test_qk_norm_rope_refuses_a_cache_of_the_wrong_shape():
    rope, qkv, pos, q_w, k_w = _qk_case(torch.float32)
    (kc, vc), slots = _cache_case(torch.float32, 13, 2, 64)
    norms = ((q_w, 1e-6), (k_w, 1e-6))
    with pytest.raises(ValueError, match=r"k_cache \(6, 16, 2, 32\)"):
        fused_ops.qk_norm_rope(
            pos, qkv, 4, 2, *norms, rope.cos, rope.sin, cache=fused_ops.CacheWrite(kc[..., :32], vc[..., :32], slots)
        )
    with pytest.raises(ValueError, match="v_cache"):
        fused_ops.qk_norm_rope(
            pos, qkv, 4, 2, *norms, rope.cos, rope.sin, cache=fused_ops.CacheWrite(kc, vc.contiguous(), slots)
        )
    with pytest.raises(ValueError, match="slot_mapping has 12 slots for 13 tokens"):
        fused_ops.qk_norm_rope(
            pos, qkv, 4, 2, *norms, rope.cos, rope.sin, cache=fused_ops.CacheWrite(kc, vc, slots[:12])
        )
