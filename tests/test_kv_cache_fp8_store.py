"""The FP8 KV cache's write side: each of K and V stored with its own scale, from any input dtype.

The module docstring promises the cache stores ``clamp(x / scale, -448, 448)`` in e4m3, one scale for
K and one for V. The engine runs with scales of 1.0 and float32 K/V, where neither a swapped scale nor
a quotient rounded in the input dtype shows; here the scales differ, are not powers of two, and the
input is bfloat16. The expected e4m3 value is found independently: the nearest of all 256 e4m3 codes
to the exact (float64) quotient.
"""

from __future__ import annotations

import torch

from nanovllm.attention import torch_ref

FP8 = torch_ref.FP8


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, sorted (the 256 codes less the two NaNs)."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    return values[torch.isfinite(values)].unique()


def _nearest_e4m3(q: torch.Tensor) -> torch.Tensor:
    """The nearest e4m3 value to each float64 in q (saturated to +-448); q must avoid exact midpoints."""
    grid = _e4m3_values()
    q = q.clamp(-448.0, 448.0)
    return grid[(q.unsqueeze(-1) - grid).abs().argmin(-1)]


def _away_from_midpoints(q: torch.Tensor) -> torch.Tensor:
    """Which float64 quotients are farther than float32 rounding (1e-6, relative) from every midpoint
    of two e4m3 neighbours: there the float32 quotient the code divides rounds the same way."""
    grid = _e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2
    gap = (q.unsqueeze(-1) - mids).abs().min(-1).values
    return gap > 1e-6 * q.abs().clamp(min=2.0**-9)


def _store(key, value, k_scale, v_scale, head_major=False):
    tokens, heads, d = key.shape
    shape = (1, heads, tokens, d) if head_major else (1, tokens, heads, d)
    k_cache, v_cache = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    torch_ref.store_kv(key, value, k_cache, v_cache, torch.arange(tokens), k_scale, v_scale, head_major=head_major)
    if head_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache[0].double(), v_cache[0].double()


def test_k_and_v_are_each_stored_with_their_own_scale():
    g = torch.Generator().manual_seed(0)
    key = torch.randn(32, 2, 16, generator=g) * 3.0
    value = torch.randn(32, 2, 16, generator=g) * 0.02
    k_scale, v_scale = 0.05, 2.0**-9 * 3  # K spans ~ +-200 / 0.05, V small: their own scales fit each
    for head_major in (False, True):
        k_stored, v_stored = _store(key, value, k_scale, v_scale, head_major)
        for stored, x, scale in ((k_stored, key, k_scale), (v_stored, value, v_scale)):
            q = x.double() / scale
            keep = _away_from_midpoints(q.flatten()).view(q.shape)
            assert keep.float().mean() > 0.99
            assert torch.equal(stored[keep], _nearest_e4m3(q)[keep]), (head_major, scale)
    # control: V quantized with K's scale is another cache
    assert not torch.equal(_store(key, value, k_scale, v_scale)[1], _store(key, value, k_scale, k_scale)[1])


def test_a_bfloat16_key_is_quantized_from_its_exact_quotient():
    """x / scale rounded once, to e4m3: not first to bfloat16 (double rounding moves values that land
    next to an e4m3 midpoint)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(256, 1, 32, generator=g) * 40).to(torch.bfloat16)
    for scale in (0.3, 0.7, 1.7):
        stored, _ = _store(x, x, scale, scale)
        q = x.double() / scale
        keep = _away_from_midpoints(q.flatten()).view(q.shape)
        assert keep.float().mean() > 0.99
        want = _nearest_e4m3(q)
        wrong = (stored[keep] != want[keep]).sum().item()
        assert wrong == 0, f"scale {scale}: {wrong} of {int(keep.sum())} values are not the nearest e4m3"
