"""The decode kernel's tiles (``triton_ops.decode_config``, ``decode_tile_flags``): 128-key tiles
for 16-bit caches, 64-key ones for FP8 caches, 32 for float32 models; one block-table entry per
tile (TILE_BLOCK) exactly when no tile can straddle two cache blocks. The kernel tests under the
interpreter (tests/gpu/test_triton_kernels.py) show what a straddling tile read with TILE_BLOCK
gets wrong."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the tile rules live in the Triton kernels' module")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanovllm.attention import triton_ops  # noqa: E402


@pytest.mark.parametrize(
    "dtype,kv_fp8,keys",
    [(torch.bfloat16, False, 128), (torch.float16, False, 128), (torch.bfloat16, True, 64), (torch.float32, False, 32)],
)
def test_keys_per_tile(dtype, kv_fp8, keys):
    assert triton_ops.decode_config(128, dtype, kv_fp8).block_n == keys


def straddles(block_size: int, block_n: int) -> bool:
    """Whether some tile [k * block_n, (k + 1) * block_n) holds slots of two blocks."""
    return any((start // block_size) != ((start + block_n - 1) // block_size) for start in range(0, 4096, block_n))


@given(
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128, 256, 512]),
    block_n=st.sampled_from([16, 32, 64, 128, 256]),
    kv_fp8=st.booleans(),
)
def test_one_table_entry_per_tile_only_when_no_tile_straddles_blocks(block_size, block_n, kv_fp8):
    flags = triton_ops.decode_tile_flags(block_size, block_n, kv_fp8, torch.bfloat16)
    assert flags["TILE_BLOCK"] is not straddles(block_size, block_n)
    assert flags["V_ASM"] is kv_fp8


def test_the_straddle_check_sees_a_straddling_tile():
    """Negative control of the property's oracle: 64-key tiles over 16-slot blocks straddle."""
    assert straddles(16, 64) and not straddles(256, 128)
