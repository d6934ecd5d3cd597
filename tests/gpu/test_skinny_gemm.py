"""The decode-batch linear kernel (nanovllm/layers/skinny_gemm.py) against F.linear.

On a GPU (marker ``gpu``) in bfloat16 and float16; under Triton's CPU interpreter
(test_triton_interpret.py) in float16. The reference is the float32 product rounded once,
which the kernel computes too (float32 accumulation): they agree within one rounding
of the dtype plus the summation-order error of float32 over K terms.
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
skinny = pytest.importorskip("nanovllm.layers.skinny_gemm", reason="needs triton")
if skinny.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)


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
    [(1, 48, 64), (7, 100, 200), (23, 64, 512)]
    if INTERPRET
    else [
        (1, 4096, 1024),
        (23, 6144, 1024),
        (64, 1024, 3072),
        (17, 1024, 2048),
        (5, 1000, 200),  # neither dimension a multiple of a block
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_skinny_linear_matches_f_linear(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, seed=m * n + k)
    y = skinny.linear(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, x, w)


@pytest.mark.parametrize("config", [skinny.SkinnyConfig(16, 64, 4, 2), skinny.SkinnyConfig(32, 128, 4, 3)])
def test_skinny_linear_configs(config):
    """Other column strips and K stages (the micro-benchmark's sweep) give the same product."""
    x, w = _case(9, 96, 320, DTYPES[0], seed=3)
    _close(skinny.linear(x, w, config), x, w)


def test_skinny_comparison_rejects_a_wrong_product():
    """Negative control: the rule refuses the product with one weight row shifted, and with the
    last K stage dropped (what an off-by-one in the K loop would give)."""
    x, w = _case(5, 48, 192, DTYPES[0], seed=11)
    with pytest.raises(AssertionError):
        _close(skinny.linear(x, torch.roll(w, 1, dims=0)), x, w)
    cut = w.clone()
    cut[:, 128:] = 0
    with pytest.raises(AssertionError):
        _close(skinny.linear(x, cut), x, w)


def test_applies_only_to_decode_sized_16_bit_rows():
    x, w = _case(4, 32, 64, DTYPES[0], seed=1)
    assert skinny.applies(x, w)
    assert not skinny.applies(torch.zeros(skinny.MAX_ROWS + 1, 64, dtype=x.dtype, device=DEVICE), w)
    assert not skinny.applies(x.float(), w.float())
    assert not skinny.applies(x[:0], w)
    assert not skinny.applies(x.t(), w)  # columns not contiguous


def test_refuses_mismatched_inner_dimension():
    x, w = _case(4, 32, 64, DTYPES[0], seed=1)
    with pytest.raises(ValueError, match="64 columns, weight has 48"):
        skinny.linear(x, w[:, :48].contiguous())


# the interpreter ignores the kernel switches (triton_switch.triton_path): "0" is checked on a GPU
SWITCH_CASES = [("1", 8, True), ("1", 65, False)] + ([] if INTERPRET else [("0", 8, False)])


@pytest.mark.parametrize("switch,rows,taken", SWITCH_CASES)
def test_linear_layers_take_the_kernel(monkeypatch, switch, rows, taken):
    """The model's linear layers route decode-sized 16-bit batches here, unless the switch is
    "0" or the batch is larger than MAX_ROWS; the output is the layer's either way."""
    from nanovllm.layers import linear as linear_mod

    monkeypatch.setenv("NANOVLLM_SKINNY_GEMM", switch)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda x, w, config=None: calls.append(x.shape) or real(x, w, config))
    layer = linear_mod.ColumnParallelLinear(64, 48).to(device=DEVICE, dtype=DTYPES[0])
    x, w = _case(rows, 48, 64, DTYPES[0], seed=rows)
    layer.weight.data.copy_(w)
    _close(layer(x), x, w)
    assert bool(calls) == taken, calls
