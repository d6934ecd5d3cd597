"""The split-K linear kernel (nanovllm/layers/splitk_gemm.py) against F.linear.

On a GPU (marker ``gpu``) in bfloat16 and float16, launched with PDL where the GPU has it; under
Triton's CPU interpreter (test_triton_interpret.py) in float16, without PDL. The reference is the
float32 product rounded once, which the kernel computes too (float32 partials summed in split order):
they agree within one rounding of the dtype plus float32's summation-order error over K terms.
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
sk = pytest.importorskip("nanovllm.layers.splitk_gemm", reason="needs triton")


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(dtype)
    return x, w


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = F.linear(x.float(), w.float()).to(x.dtype)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    torch.testing.assert_close(y, want, atol=tol, rtol=tol)


# (m, n, k, config): the interpreter's 8 stand-in SMs split a one-tile product 8 ways
SHAPES = (
    [
        (5, 64, 512, sk.SplitKConfig(64, 64, 4, 2, 16)),  # one tile, 8 splits
        (20, 100, 256, sk.SplitKConfig(64, 64, 4, 2, 16)),  # N and M past a tile: masks, 2x2 tiles, 2 splits
        (3, 32, 128, sk.SplitKConfig(16, 128, 4, 2, 16)),  # one K step: no split at all
    ]
    if INTERPRET
    else [
        (129, 4096, 1024, None),  # Qwen3-0.6B's qkv at the tail's batch 129
        (23, 6144, 1024, None),  # gate_up
        (64, 1024, 3072, None),  # down
        (17, 1024, 2048, None),  # o_proj
        (256, 1000, 384, sk.SplitKConfig(64, 64, 4, 3, 128)),  # N not a multiple of a tile, 2 row tiles
        (8, 4096, 1024, sk.SplitKConfig(128, 64, 8, 4, 16, 2)),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", SHAPES)
def test_splitk_gemm_matches_f_linear(m, n, k, config, dtype):
    x, w = _case(m, n, k, dtype, seed=m * n + k)
    y = sk.linear(x, w, config)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, x, w)


def test_split_and_counters_reset():
    """A product that splits K (checked, so the ticket path runs), called twice: the second call is
    right only if the first left every counter at zero, and the two are bitwise equal (the partials'
    sum has a fixed order)."""
    dtype = DTYPES[0]
    cfg = sk.SplitKConfig(64, 64, 4, 2, 16)
    x, w = _case(5, 64, 512, dtype, seed=3)
    tiles = 1
    assert sk.split_count(tiles, 512, 64, cfg.waves * sk._sms(x.device)) > 1
    first = sk.linear(x, w, cfg)
    assert int(sk._counters(x.device).count_nonzero()) == 0
    second = sk.linear(x, w, cfg)
    _close(second, x, w)
    assert torch.equal(first, second)


def test_row_strides_are_the_tensors_own():
    """x and the weight as views whose rows are longer than K: swapped or assumed strides fail."""
    dtype = DTYPES[0]
    x_wide, w_wide = _case(6, 80, 384, dtype, seed=21)
    x, w = x_wide[:, :256], w_wide[:, 128:]
    assert x.stride(0) == 384 and w.stride(0) == 384
    _close(sk.linear(x, w, sk.SplitKConfig(64, 64, 4, 2, 16)), x.contiguous(), w.contiguous())


def test_split_count_rule():
    assert sk.split_count(tiles=64, k=1024, block_k=128, programs=132) == 4  # 64 x 2 < 132 <= 64 x 4
    assert sk.split_count(tiles=16, k=3072, block_k=128, programs=132) == 12  # 24 steps: 8 does not divide
    assert sk.split_count(tiles=200, k=1024, block_k=128, programs=132) == 1
    assert sk.split_count(tiles=1, k=256, block_k=128, programs=132) == 2  # no more steps than that


@pytest.mark.parametrize("spec", ["sk64x128", "sk63x128x4x3x128", "sk64x128x4x3x128w0", "64x128x0x3x128"])
def test_bad_config_names_the_spec(spec):
    with pytest.raises(ValueError, match="split-K GEMM config"):
        sk.parse_config(spec)


def test_rows_switch_parses_or_names_the_variable():
    assert sk.parse_rows("0") == (0, 0)
    assert sk.parse_rows("5:256") == (5, 256)
    for bad in ("5", "0:4", "9:8", "a:b"):
        with pytest.raises(ValueError, match="NANOVLLM_SPLITK_GEMM"):
            sk.parse_rows(bad)
