"""The Triton kernels on an FP8 KV cache (float8 e4m3 with per-layer K and V scales) against
attention/torch_ref.py reading the very same FP8 cache.

The reference dequantizes exactly (e4m3 x a power-of-two scale is exact in bfloat16 and float32),
so the kernels are held to the bfloat16 tolerance of test_triton_kernels.py: what FP8 loses is
judged end to end (tests/test_kv_cache_fp8.py), not here. Each check has a negative control: the
same kernel told the wrong scale misses the reference by far more than the tolerance.
GPU only: Triton's CPU interpreter has no float8 arithmetic."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("float8 needs compute capability 8.9 or newer", allow_module_level=True)

from nanovllm.attention import torch_ref  # noqa: E402
from nanovllm.layers import fused_ops  # noqa: E402
from tests.gpu.test_fused_ops import _cache_case, _qk_case  # noqa: E402
from tests.gpu.test_triton_kernels import (  # noqa: E402
    SHAPES,
    PagedCase,
    _head_major,
    _lengths,
    _meta_cpu,
    assert_close,
    triton_ops,
)

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0  # powers of two: dequantized values are exact in bfloat16


class Fp8Case:
    def __init__(self, case: PagedCase):
        self.case = case
        # the NaN-poisoned slots stay NaN in e4m3 (a stray read still shows up)
        self.k_cache = torch_ref.quantize_fp8(case.k_cache.cpu(), K_SCALE).to("cuda")
        self.v_cache = torch_ref.quantize_fp8(case.v_cache.cpu(), V_SCALE).to("cuda")

    def reference(self) -> torch.Tensor:
        c = self.case
        return torch_ref.paged_attention(
            c.q.cpu().float(), self.k_cache.cpu(), self.v_cache.cpu(), _meta_cpu(c.meta), c.scale, K_SCALE, V_SCALE
        )


def _far(out: torch.Tensor, ref: torch.Tensor) -> bool:
    out = out.cpu().float()
    return bool(((out - ref).norm() / ref.norm()).item() > 0.1)


def test_store_kv_fp8_equals_reference_bytes():
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, t, heads, d = 16, 6, 40, 2, 128
    shape = (num_blocks, block_size, heads, d)
    k = (torch.randn(t, heads, d, generator=gen) * 4).to(torch.bfloat16)
    v = (torch.randn(t, heads, d, generator=gen) * 4).to(torch.bfloat16)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 1e-6, 0.0])  # saturates at +-448 * scale; tiny; zero
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::3] = -1
    ref_k, ref_v = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    torch_ref.store_kv(k, v, ref_k, ref_v, slots, K_SCALE, V_SCALE)
    dev_k, dev_v = torch.zeros(shape, dtype=FP8, device="cuda"), torch.zeros(shape, dtype=FP8, device="cuda")
    triton_ops.store_kv(k.cuda(), v.cuda(), dev_k, dev_v, slots.cuda(), K_SCALE, V_SCALE)
    assert torch.equal(dev_k.cpu().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(dev_v.cpu().view(torch.uint8), ref_v.view(torch.uint8))
    assert not torch.isnan(dev_k.cpu().float()).any(), "out-of-range values must saturate, not become NaN"
    # control: stored at the wrong scale, the bytes differ
    triton_ops.store_kv(k.cuda(), v.cuda(), dev_k, dev_v, slots.cuda(), 1.0, V_SCALE)
    assert not torch.equal(dev_k.cpu().view(torch.uint8), ref_k.view(torch.uint8))


@pytest.mark.parametrize("block_size,group,head_dim", SHAPES[::3])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("wide_mma", [0, 3])
def test_decode_fp8_matches_reference(block_size, group, head_dim, splits, wide_mma, monkeypatch):
    monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "WIDE_MMA", wide_mma)
    rng = random.Random(block_size * 1000 + group * 10 + head_dim + splits)
    lens = _lengths(block_size, rng, 9, 4096)
    fc = Fp8Case(PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30)))
    c = fc.case

    def run(v_scale: float) -> torch.Tensor:
        out = torch.full_like(c.q, float("nan"))
        triton_ops.paged_decode(
            c.q, fc.k_cache, fc.v_cache, c.meta.block_tables, c.meta.seq_lens, c.scale,
            num_splits=splits, out=out, k_scale=K_SCALE, v_scale=v_scale,
        )  # fmt: skip
        return out

    ref = fc.reference()
    assert_close(run(V_SCALE), ref, f"fp8 decode bs={block_size} g={group} d={head_dim} splits={splits}")
    assert _far(run(1.0), ref), "control: the wrong v_scale must miss the reference"


@pytest.mark.parametrize("block_size,group,head_dim", [(256, 2, 128), (128, 8, 64), (256, 1, 64)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("wide_mma", [0, 3])
@pytest.mark.parametrize("maxnreg", [None, 128])
def test_decode_fp8_tma_matches_reference(block_size, group, head_dim, splits, wide_mma, maxnreg, monkeypatch):
    """The shipped FP8 path on a Hopper GPU: a head-major cache of whole 128-key boxes takes TMA by
    default (128-key boxes, double-buffered); the NaN-poisoned slots past each sequence's end are
    read by the boxes and must be masked. Control: the wrong v_scale misses. ``wide_mma``: the
    widened tiles as 8-bit-loaded MMA operands (0) or as 16-bit ones (3); ``maxnreg``: the shipped
    tiles with at most 128 registers per thread (an A/B config, session 25)."""
    monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "WIDE_MMA", wide_mma)
    rng = random.Random(block_size * 77 + group * 10 + head_dim + splits)
    lens = _lengths(block_size, rng, 9, 4096)
    assert any(n % triton_ops.TMA_BLOCK_N for n in lens)
    fc = Fp8Case(PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30)))
    c = fc.case
    k, v = _head_major(fc.k_cache), _head_major(fc.v_cache)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0 or newer")
    assert triton_ops.wants_tma(c.q, k, v), "the default must take TMA here"
    config = None
    if maxnreg is not None:
        shipped = triton_ops.decode_config(head_dim, c.q.dtype, kv_fp8=True, tma=True)
        config = dataclasses.replace(shipped, maxnreg=maxnreg)
    made = []
    real = triton_ops.tma_descriptors
    monkeypatch.setattr(triton_ops, "tma_descriptors", lambda *a: made.append(real(*a)) or made[-1])
    launched = []  # the compiled kernels this test's calls launch (JITFunction.run returns each)
    run_kernel = triton_ops._decode_kernel.run
    monkeypatch.setattr(
        triton_ops._decode_kernel, "run", lambda *a, **kw: launched.append(run_kernel(*a, **kw)) or launched[-1]
    )

    def run(v_scale: float) -> torch.Tensor:
        out = torch.full_like(c.q, float("nan"))
        triton_ops.paged_decode(
            c.q, k, v, c.meta.block_tables, c.meta.seq_lens, c.scale,
            num_splits=splits, out=out, k_scale=K_SCALE, v_scale=v_scale, config=config,
        )  # fmt: skip
        return out

    ref = fc.reference()
    assert_close(run(V_SCALE), ref, f"fp8 TMA decode bs={block_size} g={group} d={head_dim} splits={splits}")
    assert made and all(d is not None for d in made), "the launch must have used TMA descriptors"
    assert _far(run(1.0), ref), "control: the wrong v_scale must miss the reference"
    # the kernels these calls launched were built with the cap asked for (None: the shipped launch
    # asks for none, the control of the capped cases), and a capped one uses no more registers
    assert launched and {kern.metadata.maxnreg for kern in launched} == {maxnreg}, launched
    if maxnreg is not None:
        assert all(kern.n_regs <= maxnreg for kern in launched), [kern.n_regs for kern in launched]


@pytest.mark.parametrize("programs", [3, None])
def test_decode_fp8_streamk_matches_reference(programs):
    """Stream-K decode (``decode_streamk``) on the shipped FP8 path: TMA boxes of the head-major
    cache, V widened by PTX and clamped finite instead of masked (``V_FINITE``), registers capped
    (``MAXNREG``). The NaN-poisoned slots past each sequence's end are read by the boxes: their
    scores must be -inf and their V rows must add nothing. ``programs``: 3 (programs start and end
    mid-item) or one wave (the default). Control: the wrong v_scale misses."""
    from nanovllm.attention import decode_streamk

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0 or newer")
    rng = random.Random(31 + (programs or 0))
    lens = [0] + _lengths(256, rng, 9, 4096)  # a padding row (seq_len 0) first
    fc = Fp8Case(PagedCase([(max(n - 1, 0), 1) for n in lens], 256, 2, 128, seed=rng.randint(0, 1 << 30)))
    c = fc.case
    seq_lens = c.meta.seq_lens.clone()
    seq_lens[0] = 0
    k, v = _head_major(fc.k_cache), _head_major(fc.v_cache)
    assert triton_ops.wants_tma(c.q, k, v)
    # the boxes past some sequence's end hold NaN bytes in V: what V_FINITE must neutralise
    assert any(n % triton_ops.TMA_BLOCK_N for n in lens[1:]) and torch.isnan(fc.v_cache.float()).any()

    def run(v_scale: float) -> torch.Tensor:
        out = torch.full_like(c.q, float("nan"))
        decode_streamk.paged_decode_streamk(
            c.q, k, v, c.meta.block_tables, seq_lens, c.scale, programs=programs, out=out, k_scale=K_SCALE,
            v_scale=v_scale,
        )  # fmt: skip
        return out

    ref = fc.reference()
    out = run(V_SCALE)
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu())), "the padding row must be zeros"
    assert_close(out[1:], ref[1:], f"fp8 stream-K decode programs={programs}")
    assert _far(run(1.0)[1:], ref[1:]), "control: the wrong v_scale must miss the reference"


def test_fp8_finite_widening_clamps_only_nan():
    """``_fp8_to_finite_f16_asm`` (stream-K's unmasked V): every e4m3 byte but NaN widens to the
    value ``_fp8_to_f16_asm`` gives (torch's conversion), and NaN (0x7F, 0xFF) to a finite value.
    Control: the plain widening gives NaN for those two bytes, so the check sees them."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x_ptr, out_ptr, FINITE: tl.constexpr):
        offs = tl.arange(0, 256)
        x = tl.load(x_ptr + offs)
        if FINITE:
            tl.store(out_ptr + offs, triton_ops._fp8_to_finite_f16_asm(x))
        else:
            tl.store(out_ptr + offs, triton_ops._fp8_to_f16_asm(x))

    x = torch.arange(256, dtype=torch.uint8, device="cuda").view(FP8)
    nan = torch.isnan(x.float())
    assert nan.sum() == 2, "e4m3fn has two NaN bytes"

    def run(finite: bool) -> torch.Tensor:
        out = torch.empty(256, dtype=torch.float16, device="cuda")
        widen[(1,)](x, out, FINITE=finite)
        return out

    plain, finite = run(False), run(True)
    assert torch.equal(plain[~nan], x.to(torch.float16)[~nan])
    assert torch.isnan(plain[nan]).all(), "control: the plain widening keeps NaN"
    assert torch.equal(finite[~nan], plain[~nan]) and torch.isfinite(finite).all()


def test_fp8_pair_widening_splits_every_int16_into_its_two_bytes():
    """``_fp8_pairs_to_f16_asm`` (``V_PAIRS``) on all 65,536 int16 values, in tiles shaped as the
    decode tile's V ([keys, dim pairs]): the even output is the low byte widened by torch's e4m3
    conversion, the odd one the high byte; ``FINITE`` changes only the NaN bytes, to finite values.
    Control: the two outputs swapped miss (every byte pair but equal ones tells them apart)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split(x_ptr, even_ptr, odd_ptr, FINITE: tl.constexpr):
        offs = tl.program_id(0) * 4096 + tl.arange(0, 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
        even, odd = triton_ops._fp8_pairs_to_f16_asm(tl.load(x_ptr + offs), FINITE)
        tl.store(even_ptr + offs, even)
        tl.store(odd_ptr + offs, odd)

    # every int16 once, scrambled (an odd multiplier permutes 16-bit values): neighbouring elements,
    # which a call may take together, differ in both bytes, so a selector that swaps bytes between
    # them (0x1320) fails; in plain order their high bytes are equal and it would pass
    x = (torch.arange(1 << 16, dtype=torch.int64) * 40503 & 0xFFFF).to(torch.int16).cuda()
    lo, hi = (x.view(torch.uint8).view(-1, 2)[:, i].contiguous().view(FP8) for i in (0, 1))

    def run(finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
        even, odd = (torch.empty(x.numel(), dtype=torch.float16, device="cuda") for _ in range(2))
        split[(x.numel() // 4096,)](x, even, odd, FINITE=finite)
        return even, odd

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN where b is NaN
        nan = torch.isnan(b)
        return bool(torch.equal(a[~nan], b[~nan]) and torch.isnan(a[nan]).all())

    even, odd = run(False)
    assert same(even, lo.to(torch.float16)) and same(odd, hi.to(torch.float16))
    assert not same(odd, lo.to(torch.float16)), "control: the high bytes are not the low ones"
    f_even, f_odd = run(True)
    for got, plain in ((f_even, even), (f_odd, odd)):
        nan = torch.isnan(plain)
        assert nan.any() and torch.isfinite(got).all() and torch.equal(got[~nan], plain[~nan])


@pytest.mark.parametrize("kernel", ["shipped", "streamk"])
@pytest.mark.parametrize("block_size,group,head_dim,splits", [(256, 2, 128, 1), (256, 2, 128, 3), (128, 8, 64, 2)])
def test_decode_fp8_v_pairs_matches_the_byte_wise_v(kernel, block_size, group, head_dim, splits, monkeypatch):
    """``V_PAIRS`` (the default on a Hopper GPU since session 29: V's TMA boxes read as int16 dim
    pairs, two PV products a tile) against the reference and against the byte-wise V of sessions
    11-28, in the shipped kernel and in stream-K (``splits``: its programs per SM there). The launches
    are shown to take each path: V's descriptor is int16 with pairs, FP8 without. Controls: the
    output with its even and odd dims swapped misses the reference (the mistake the halves invite),
    and so does the wrong v_scale."""
    from nanovllm.attention import decode_streamk

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0 or newer")
    rng = random.Random(block_size + group * 7 + head_dim * 3 + splits)
    lens = [0] + _lengths(block_size, rng, 9, 4096)  # a padding row first
    fc = Fp8Case(
        PagedCase([(max(n - 1, 0), 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    )
    c = fc.case
    seq_lens = c.meta.seq_lens.clone()
    seq_lens[0] = 0
    k, v = _head_major(fc.k_cache), _head_major(fc.v_cache)
    assert triton_ops.wants_tma(c.q, k, v) and torch.isnan(fc.v_cache.float()).any()
    made = []
    real = triton_ops.tma_descriptors
    monkeypatch.setattr(triton_ops, "tma_descriptors", lambda *a: made.append(real(*a)) or made[-1])

    def run(v_pairs: bool, v_scale: float = V_SCALE) -> torch.Tensor:
        monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "V_PAIRS", v_pairs)
        made.clear()
        out = torch.full_like(c.q, float("nan"))
        if kernel == "shipped":
            triton_ops.paged_decode(
                c.q, k, v, c.meta.block_tables, seq_lens, c.scale, num_splits=splits, out=out, k_scale=K_SCALE,
                v_scale=v_scale,
            )  # fmt: skip
        else:
            programs = splits * torch.cuda.get_device_properties(0).multi_processor_count
            decode_streamk.paged_decode_streamk(
                c.q, k, v, c.meta.block_tables, seq_lens, c.scale, programs=programs, out=out, k_scale=K_SCALE,
                v_scale=v_scale,
            )  # fmt: skip
        assert made and all(d is not None for d in made), "the launch must have used TMA descriptors"
        want = torch.int16 if v_pairs else FP8
        assert all(d[1].base.dtype == want for d in made), [d[1].base.dtype for d in made]
        return out

    ref = fc.reference()
    pairs, bytes_ = run(True), run(False)
    what = f"fp8 V pairs {kernel} bs={block_size} g={group} d={head_dim} splits={splits}"
    assert_close(pairs[1:], ref[1:], what)
    assert_close(bytes_[1:], ref[1:], what + " (bytes)")
    if kernel == "shipped" and splits == 1:  # the padding row's program writes zeros
        assert torch.equal(pairs[0].cpu(), torch.zeros_like(pairs[0].cpu()))
    diff = (pairs[1:].float() - bytes_[1:].float()).abs().max().item()
    assert diff <= 1e-2 * bytes_[1:].float().abs().max().item(), f"{what}: pairs and bytes differ by {diff}"
    swapped = pairs.unflatten(-1, (head_dim // 2, 2)).flip(-1).flatten(-2)
    assert _far(swapped[1:], ref[1:]), "control: the dims of each pair swapped must miss the reference"
    assert _far(run(True, 1.0)[1:], ref[1:]), "control: the wrong v_scale must miss the reference"


@pytest.mark.parametrize("block_size,group,head_dim", SHAPES[1::4])
def test_prefill_fp8_matches_reference(block_size, group, head_dim):
    rng = random.Random(block_size * 31 + group * 7 + head_dim)
    specs = [(0, 1), (0, rng.randint(2, 600)), (block_size, rng.randint(1, 600)), (rng.randint(1, 3000), 300)]
    fc = Fp8Case(PagedCase(specs, block_size, group, head_dim, seed=rng.randint(0, 1 << 30)))
    c = fc.case

    def run(k_scale: float) -> torch.Tensor:
        out = torch.full_like(c.q, float("nan"))
        triton_ops.paged_prefill(
            c.q, fc.k_cache, fc.v_cache, c.meta.query_start_loc, c.meta.seq_lens, c.meta.block_tables, c.scale,
            out=out, k_scale=k_scale, v_scale=V_SCALE,
        )  # fmt: skip
        return out

    ref = fc.reference()
    assert_close(run(K_SCALE), ref, f"fp8 prefill bs={block_size} g={group} d={head_dim}")
    assert _far(run(4 * K_SCALE), ref), "control: the wrong k_scale must miss the reference"


@pytest.mark.parametrize("t,hq,hk,d", [(11, 16, 8, 128), (13, 4, 2, 64)])  # the second mixes q, k, v heads in a tile
@pytest.mark.parametrize("v_scale", [0.5, 0.005])  # 0.005: v / scale beyond 448, so the clamp decides bytes
def test_qk_norm_rope_writes_an_fp8_cache_with_its_scales(t, hq, hk, d, v_scale):
    """Qwen3's fused q/k kernel with the K/V store (``fused_ops.CacheWrite``) quantizes as the store
    kernel does: the same bytes, with a control told another v_scale."""
    rope, qkv, pos, q_w, k_w = _qk_case(torch.bfloat16, t, hq, hk, d, seed=5)
    (want_kc, want_vc), slots = _cache_case(FP8, t, hk, d)
    (kc, vc), _ = _cache_case(FP8, t, hk, d)

    def fused(k_scale, v_scale):
        write = fused_ops.CacheWrite(kc, vc, slots, k_scale, v_scale)
        fused_ops.qk_norm_rope(pos, qkv, hq, hk, (q_w, 1e-6), (k_w, 1e-6), rope.cos, rope.sin, cache=write)

    _, k = fused_ops.qk_norm_rope(pos, qkv, hq, hk, (q_w, 1e-6), (k_w, 1e-6), rope.cos, rope.sin)
    triton_ops.store_kv(k, qkv[:, (hq + hk) * d :].view(t, hk, d), want_kc, want_vc, slots, 0.05, v_scale)
    if v_scale < 0.1:
        assert (qkv[:, (hq + hk) * d :].float().abs() / v_scale > 448).any(), "no value reaches the clamp"
    fused(0.05, v_scale)
    assert torch.equal(kc.view(torch.uint8), want_kc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_vc.view(torch.uint8))
    fused(0.05, 2 * v_scale)
    assert not torch.equal(vc.view(torch.uint8), want_vc.view(torch.uint8)), "control: another v_scale"
