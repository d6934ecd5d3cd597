"""scripts/ncu_decode.py: the decode step it builds for the profiler has the engine's cache layout and
a valid block map, and its config specs parse (the GPU run itself needs a Hopper GPU and ncu)."""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention import triton_ops
from scripts.ncu_decode import BLOCK, HK, HQ, D, parse_tile, tail_step


def _head_major(k: torch.Tensor) -> bool:
    """A cache [blocks, slots, kv heads, d] stored head-major: a head's slots of a block are
    contiguous rows of d, as the engine's Triton cache is."""
    nb = k.shape[0]
    return k.shape == (nb, BLOCK, HK, D) and k.stride() == (HK * BLOCK * D, D, BLOCK * D, 1)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_the_step_is_head_major_with_each_block_used_once(kv):
    q, k, v, bt, sl = tail_step(5, 600, kv, device="cpu")
    want = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    assert k.dtype == v.dtype == want and q.shape == (5, HQ, D)
    assert _head_major(k) and _head_major(v)
    assert not _head_major(k.contiguous()), "control: the slot-major storage of the same cache fails the check"
    lens = sl.tolist()
    assert all(300 <= n < 900 for n in lens), lens
    used = []
    for row, n in zip(bt.tolist(), lens):
        blocks = -(-n // BLOCK)
        used += row[:blocks]
        assert all(b == 0 for b in row[blocks:]), "padding past a sequence's blocks"
    assert sorted(used) == list(range(k.shape[0])), "every block belongs to exactly one sequence"
    assert used != sorted(used), "the blocks are shuffled, as an engine's cache is after a while"


def test_tile_specs():
    assert parse_tile("shipped") is None  # the engine's own config
    assert parse_tile("128x4x5") == triton_ops.KernelConfig(16, 128, 4, 5)
    assert parse_tile("64x4x5x128") == triton_ops.KernelConfig(16, 64, 4, 5, 128)
    with pytest.raises(ValueError):
        parse_tile("128x4")
