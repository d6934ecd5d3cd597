"""The decode-batch linear kernel (nanovllm/layers/decode_gemm.py) against F.linear.

On a GPU (marker ``gpu``) in bfloat16 and float16, launched with PDL where the GPU has it; under
Triton's CPU interpreter (test_triton_interpret.py) in float16, without PDL. The reference is the float32 product rounded once, which the kernel computes
too (float32 accumulation): they agree within one rounding of the dtype plus float32's summation-order
error over K terms.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]
gemm = pytest.importorskip("nanovllm.layers.decode_gemm", reason="needs triton")


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(dtype)
    return x, w


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = F.linear(x.float(), w.float()).to(x.dtype)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    torch.testing.assert_close(y, want, atol=tol, rtol=tol)


SHAPES = (
    [(1, 48, 128), (7, 100, 256), (23, 64, 512), (70, 32, 128)]
    if INTERPRET
    else [
        (1, 4096, 1024),  # Qwen3-0.6B's qkv
        (23, 6144, 1024),  # gate_up
        (64, 1024, 3072),  # down
        (17, 1024, 2048),  # o_proj
        (5, 1000, 384),  # N not a multiple of a strip, K not of 256
        (200, 4096, 1024),  # several row blocks (MAX_ROWS raised for the test)
    ]
)


@pytest.fixture(autouse=True)
def _rows_up_to_256(monkeypatch):
    monkeypatch.setattr(gemm, "MAX_ROWS", 256)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_decode_gemm_matches_f_linear(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, seed=m * n + k)
    assert gemm.applies(x, w, None)
    y = gemm.linear(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, x, w)


CONFIGS = [gemm.GemmConfig(16, 128, 4, 2), gemm.GemmConfig(64, 128, 4, 4), gemm.GemmConfig(32, 256, 8, 3)]


def test_row_strides_are_the_tensors_own():
    """x and the weight as views whose rows are longer than K (a slice of wider tensors: row strides
    that are not K), and an output check against the same product: swapped or assumed strides fail."""
    dtype = DTYPES[0]
    x_wide, w_wide = _case(6, 80, 384, dtype, seed=21)
    x, w = x_wide[:, :256], w_wide[:, 128:]
    assert x.stride(0) == 384 and w.stride(0) == 384 and gemm.applies(x, w, None)
    _close(gemm.linear(x, w), x.contiguous(), w.contiguous())


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_gemm_configs(config):
    """Other strips, K steps, warps and stages (the micro-benchmark's sweep) give the same product."""
    x, w = _case(9, 96, 512, DTYPES[0], seed=3)
    _close(gemm.linear(x, w, config), x, w)


def test_rows_do_not_depend_on_their_batch():
    """A row's result is the same bits alone and in any batch (the K loop's order is the row's own)."""
    x, w = _case(40, 64, 256, DTYPES[0], seed=5)
    full = gemm.linear(x, w)
    for rows in (x[:1], x[3:20], x[39:]):
        start = int((x == rows[0]).all(dim=1).nonzero()[0])
        assert torch.equal(gemm.linear(rows.contiguous(), w), full[start : start + rows.shape[0]])


def test_decode_gemm_comparison_rejects_a_wrong_product():
    """Negative control: the rule refuses the product with one weight row shifted, and with the
    second half of K dropped (what a K loop that stops early would give)."""
    x, w = _case(5, 48, 256, DTYPES[0], seed=11)
    with pytest.raises(AssertionError):
        _close(gemm.linear(x, torch.roll(w, 1, dims=0)), x, w)
    cut = w.clone()
    cut[:, 128:] = 0
    with pytest.raises(AssertionError):
        _close(gemm.linear(x, cut), x, w)


def test_applies_only_to_decode_sized_16_bit_rows(monkeypatch):
    monkeypatch.setattr(gemm, "MAX_ROWS", 64)
    x, w = _case(4, 32, 128, DTYPES[0], seed=1)
    assert gemm.applies(x, w, None)
    assert not gemm.applies(torch.zeros(65, 128, dtype=x.dtype, device=DEVICE), w, None)
    assert not gemm.applies(x.float(), w.float(), None)
    assert not gemm.applies(x[:0], w, None)
    assert not gemm.applies(x, w, torch.zeros(32, dtype=x.dtype, device=DEVICE))  # a bias: cuBLAS
    assert not gemm.applies(x[:, :64], w[:, :64], None)  # K not whole 128-element lines
    assert not gemm.applies(x, w[:, :96], None)  # inner dimensions differ
    assert not gemm.applies(x, w[0], None)  # a 1-D weight: refused, not an IndexError
    wide = torch.zeros(4, 256, dtype=x.dtype, device=DEVICE)
    assert not gemm.applies(wide[:, ::2], w, None)  # columns not contiguous


def test_refuses_k_not_a_multiple_of_the_step():
    x, w = _case(4, 32, 384, DTYPES[0], seed=1)
    with pytest.raises(ValueError, match="K=384 is not a multiple of block_k=256"):
        gemm.linear(x, w, gemm.GemmConfig(32, 256, 4, 3))


@pytest.mark.parametrize("switch,rows", [(None, 1), ("1", 4), ("1", 5), ("0", 1)])
def test_linear_layers_take_the_kernel(monkeypatch, switch, rows):
    """The model's linear layers route the smallest 16-bit decode batches here: with the switch "1",
    or unset where PDL is on (Hopper and later; not under the interpreter), never above MAX_ROWS
    or with the switch "0"; the output is the layer's either way."""
    from nanovllm.layers import linear as linear_mod

    monkeypatch.setattr(gemm, "MAX_ROWS", 4)
    if switch is None:
        monkeypatch.delenv(gemm.SWITCH, raising=False)
    else:
        monkeypatch.setenv(gemm.SWITCH, switch)
    calls = []
    real = gemm.linear
    monkeypatch.setattr(gemm, "linear", lambda x, w, config=None: calls.append(x.shape) or real(x, w, config))
    layer = linear_mod.ColumnParallelLinear(128, 48).to(device=DEVICE, dtype=DTYPES[0])
    x, w = _case(rows, 48, 128, DTYPES[0], seed=rows)
    layer.weight.data.copy_(w)
    _close(layer(x), x, w)
    on = switch == "1" or (switch is None and gemm.pdl.enabled(x))
    assert bool(calls) == (on and rows <= 4), calls
    if switch is None and not INTERPRET and torch.cuda.get_device_capability()[0] >= 9:
        assert calls, "on by default on a Hopper GPU"


# The preloading kernel (session 16): the whole weight strip loaded before the PDL wait, K in up to
# four power-of-two chunks, the rows BLOCK_M at a time.
PRELOAD_SHAPES = (
    [(1, 48, 128), (7, 100, 256), (23, 64, 384), (40, 32, 512), (3, 16, 48)]
    if INTERPRET
    else [
        (1, 4096, 1024),  # qkv: one chunk
        (23, 6144, 1024),  # gate_up
        (64, 1024, 3072),  # down: three chunks of 1,024
        (17, 1024, 2048),  # o_proj: two chunks
        (5, 1000, 384),  # N not a multiple of a strip; three chunks of 128
        (200, 4096, 1024),  # 13 row steps of 16
        (9, 512, 4096),  # four chunks
    ]
)


@pytest.fixture
def preload_rows(monkeypatch):
    monkeypatch.setattr(gemm, "PRELOAD_MAX_ROWS", 256)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", PRELOAD_SHAPES)
def test_preload_gemm_matches_f_linear(m, n, k, dtype, preload_rows):
    x, w = _case(m, n, k, dtype, seed=m * n + k + 1)
    assert gemm.preload_applies(x, w, None)
    y = gemm.preload_linear(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, x, w)


@pytest.mark.parametrize("config", [gemm.PreloadConfig(16, 32, 4), gemm.PreloadConfig(64, 16, 8)])
def test_preload_gemm_configs_and_row_strides(config):
    """Other strips, row steps and warps give the same product; x and the weight as views whose rows
    are longer than K, K in three chunks (swapped or assumed strides, or chunk offsets taken from K
    instead of the chunk, fail)."""
    x_wide, w_wide = _case(37, 80, 512, DTYPES[0], seed=23)
    x, w = x_wide[:, :384], w_wide[:, 128:]
    assert x.stride(0) == 512 and w.stride(0) == 512 and gemm.k_chunks(384) == (128, 3)
    _close(gemm.preload_linear(x, w, config), x.contiguous(), w.contiguous())


def test_preload_rows_do_not_depend_on_their_batch():
    """A row's result is the same bits alone and in any batch, whichever row step it falls in."""
    x, w = _case(40, 64, 256, DTYPES[0], seed=5)
    full = gemm.preload_linear(x, w)
    for start, stop in ((0, 1), (3, 20), (17, 18), (39, 40)):
        assert torch.equal(gemm.preload_linear(x[start:stop].contiguous(), w), full[start:stop])


def test_preload_comparison_rejects_a_wrong_product():
    """Negative control: one weight row shifted, and the last K chunk dropped (a kernel that used
    NK - 1 chunks), each fail the rule."""
    x, w = _case(5, 48, 384, DTYPES[0], seed=11)
    with pytest.raises(AssertionError):
        _close(gemm.preload_linear(x, torch.roll(w, 1, dims=0)), x, w)
    cut = w.clone()
    cut[:, 256:] = 0
    with pytest.raises(AssertionError):
        _close(gemm.preload_linear(x, cut), x, w)


def test_k_chunks_and_what_the_preload_kernel_takes(preload_rows):
    assert gemm.k_chunks(1024) == (1024, 1) and gemm.k_chunks(3072) == (1024, 3)
    assert gemm.k_chunks(384) == (128, 3) and gemm.k_chunks(4096) == (1024, 4)
    assert gemm.k_chunks(1280) is None  # five chunks of 256
    assert gemm.k_chunks(40) is None  # chunks of 8: under tl.dot's 16
    x, w = _case(4, 32, 128, DTYPES[0], seed=1)
    assert gemm.preload_applies(x, w, None)
    assert not gemm.preload_applies(torch.zeros(257, 128, dtype=x.dtype, device=DEVICE), w, None)
    assert not gemm.preload_applies(x.float(), w.float(), None)
    assert not gemm.preload_applies(x[:0], w, None)
    assert not gemm.preload_applies(x, w, torch.zeros(32, dtype=x.dtype, device=DEVICE))
    assert not gemm.preload_applies(x[:, :40], w[:, :40], None)
    # shared memory: a 32-column strip of K = 4,096 needs 294,912 bytes (over sm_90's 232,448): cuBLAS;
    # a 16-column one fits
    big = torch.zeros(4096, 4096, dtype=x.dtype, device="meta")
    assert not gemm.preload_applies(torch.zeros(1, 4096, dtype=x.dtype, device="meta"), big, None)
    assert gemm.preload_applies(torch.zeros(1, 4096, dtype=x.dtype, device="meta"), big[:512], None)
    assert gemm.shared_bytes(gemm.preload_config(4096, 1024), 1024, 1024) == 98_304
    with pytest.raises(ValueError, match="K=1280 is not 4 or fewer power-of-two chunks"):
        gemm.preload_linear(
            torch.zeros(2, 1280, dtype=x.dtype, device=DEVICE), torch.zeros(16, 1280, dtype=x.dtype, device=DEVICE)
        )


def test_the_preloading_kernel_and_the_early_release_ship_off():
    """Neither has run on a GPU against cuBLAS yet (KERNEL_NOTES session 16): off until measured."""
    from nanovllm.layers import fused_ops

    assert gemm.PRELOAD_MAX_ROWS == 0 and fused_ops.EARLY_RELEASE is False


@pytest.mark.parametrize("limit,rows,taken", [(0, 1, False), (8, 8, True), (8, 9, False)])
def test_linear_layers_take_the_preload_kernel(monkeypatch, limit, rows, taken):
    """Up to PRELOAD_MAX_ROWS rows the model's linear layers take the preloading kernel (before the
    strip kernel); 0 leaves it off. The output is the layer's either way."""
    from nanovllm.layers import linear as linear_mod

    monkeypatch.setattr(gemm, "PRELOAD_MAX_ROWS", limit)
    monkeypatch.setenv(gemm.SWITCH, "1")
    calls = []
    real = gemm.preload_linear
    monkeypatch.setattr(gemm, "preload_linear", lambda x, w, config=None: calls.append(x.shape) or real(x, w, config))
    layer = linear_mod.ColumnParallelLinear(128, 48).to(device=DEVICE, dtype=DTYPES[0])
    x, w = _case(rows, 48, 128, DTYPES[0], seed=rows)
    layer.weight.data.copy_(w)
    _close(layer(x), x, w)
    assert bool(calls) == taken, calls
