"""The roofline's totals against a hand count on a tiny shape, not only against each other: the
existing checks (slower memory, FP8 halves the K/V bytes) hold for any constant factor, so a
decode step too many or K without V passed them."""

from __future__ import annotations

import pytest

from nanovllm.bench.roofline import DeviceLimits, roofline
from nanovllm.bench.workloads import Workload

# hidden 8, 2 layers, 2 query heads and 1 K/V head of dim 4, MLP 16, vocabulary 32
TINY = dict(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=32,
)
# per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate and up 8x16 each + down 16x8 = 576; 2 layers + head 32x8
PARAMS = 2 * (64 + 32 + 32 + 64 + 2 * 128 + 128) + 32 * 8
DEVICE = DeviceLimits("test", 1e6, 1e4, "hand-made")


def test_decode_bytes_match_a_hand_count():
    """Prompts of 3 and 5 tokens asking 4 and 2 tokens: the first token of each comes from the
    prefill, so the batch takes 3 decode steps, each reading every bf16 weight once. K/V: each
    cached token holds K and V (2 x 4 values) in 2 layers at 2 bytes, 32 bytes; the first request
    reads 4, 5 and 6 tokens in its 3 steps, the second 6 in its one: 21 tokens."""
    w = Workload("hand", [[1, 2, 3], [1, 2, 3, 4, 5]], [4, 2], 0.0)
    r = roofline(w, TINY, DEVICE)
    assert r.decode_weight_bytes == 3 * PARAMS * 2
    assert r.decode_kv_bytes == 21 * 32
    assert roofline(w, TINY, DEVICE, kv_bytes_per_elem=1).decode_kv_bytes == 21 * 16
    # prefill: 2 FLOPs per weight per prompt token, 4 * layers * q_dim * (1 + ... + len) for
    # attention, and the head on each prompt's last token only
    body = PARAMS - 32 * 8
    prefill = sum(2 * body * n + 4 * 2 * 8 * n * (n + 1) // 2 + 2 * 32 * 8 for n in (3, 5))
    assert r.prefill_flops == prefill
    seconds = prefill / 1e6 + (3 * PARAMS * 2 + 21 * 32) / 1e4
    assert r.seconds == pytest.approx(seconds) and r.output_tokens_per_s == pytest.approx(6 / seconds)


def test_one_token_requests_have_no_decode():
    """max_tokens 1: the prefill gives the only token; nothing is decoded, no byte read for it."""
    w = Workload("prefill only", [[1, 2, 3, 4], [5, 6]], [1, 1], 0.0)
    r = roofline(w, TINY, DEVICE)
    assert (r.decode_weight_bytes, r.decode_kv_bytes) == (0, 0)
    assert r.seconds == pytest.approx(r.prefill_flops / DEVICE.bf16_flops)
