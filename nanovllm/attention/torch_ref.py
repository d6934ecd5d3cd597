"""Paged attention in plain PyTorch: the CPU path and the oracle for GPU kernels.

Cache layout, one tensor each for K and V per layer: [num_blocks, block_size,
num_kv_heads, head_dim]; slot s is position ``s % block_size`` of block
``s // block_size``. Softmax is computed in float32.

An FP8 cache (``torch.float8_e4m3fn``) stores ``clamp(x / scale, -448, 448)`` in e4m3 and is read
back as ``e4m3 * scale``, one scale per layer for K and one for V (vLLM's ``k_scale``/``v_scale``).
"""

from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.core.utils import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated to the finite range (e4m3fn has no infinity)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # indexing kernels for float8 are missing on some builds: move FP8 data as bytes
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _load(t: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache elements (bytes of an FP8 cache) as float32 values."""
    return t.view(FP8).float().mul_(scale) if cache_dtype == FP8 else t.float()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each new token's K/V into its slot; slot -1 writes nothing."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if k_cache.dtype == FP8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    _bytes(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _bytes(key))
    _bytes(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _bytes(value))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence: [seq_len, num_kv_heads, head_dim], float32."""
    block_size = cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = _bytes(cache).index_select(0, block_table[:num_blocks].long())
    return _load(blocks.flatten(0, 1)[:seq_len], cache.dtype, scale)


def attention_one_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, bottom-right aligned: query row j sits at position
    ``len(k) - len(q) + j`` and sees keys ``0 ..`` that position.

    q: [n_q, num_heads, d]; k, v: [n_k, num_kv_heads, d] -> [n_q, num_heads, d].
    """
    n_q, num_heads, d = q.shape
    n_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.float().view(n_q, num_kv_heads, group, d).permute(1, 2, 0, 3)  # [kvh, g, n_q, d]
    kf = k.float().permute(1, 2, 0)  # [kvh, d, n_k]
    vf = v.float().permute(1, 0, 2)  # [kvh, n_k, d]
    scores = torch.matmul(qg, kf.unsqueeze(1)) * scale  # [kvh, g, n_q, n_k]
    if n_q > 1:
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device).unsqueeze(1)
        k_pos = torch.arange(n_k, device=q.device).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf.unsqueeze(1))  # [kvh, g, n_q, d]
    return out.permute(2, 0, 1, 3).reshape(n_q, num_heads, d).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The oracle: one sequence at a time, K/V read through the block table."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        s, e = starts[i], starts[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, k_scale)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, v_scale)
        out[s:e] = attention_one_seq(q[s:e], k, v, scale)
    return out


def paged_decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query per sequence, all sequences at once: the CPU decode path.

    Each sequence's blocks (padded to the longest table) are gathered *and* transposed to
    [block, kv_head, slot, d] in one copy, so both products are plain batched matmuls over
    blocks: no further copy of K or V. Scores of all blocks of a sequence are joined for one
    softmax; positions past ``seq_len`` are masked (and their V zeroed when they hold NaN or
    inf: never-written slots may, and 0 * NaN is NaN).
    """
    num_seqs, num_heads, d = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    nb = cdiv(meta.max_seq_len, block_size)
    n = num_seqs * nb
    table = meta.block_tables[:, :nb].reshape(-1).long()
    k = _load(_bytes(k_cache).permute(0, 2, 1, 3).index_select(0, table), k_cache.dtype, k_scale)  # [n, kvh, bs, d]
    v = _load(_bytes(v_cache).permute(0, 2, 1, 3).index_select(0, table), v_cache.dtype, v_scale)
    qg = q.float().view(num_seqs, 1, num_kv_heads, group, d).expand(num_seqs, nb, num_kv_heads, group, d)
    scores = torch.matmul(qg.reshape(n, num_kv_heads, group, d), k.transpose(-1, -2)).mul_(scale)
    scores = scores.view(num_seqs, nb, num_kv_heads, group, block_size).permute(0, 2, 3, 1, 4)
    scores = scores.reshape(num_seqs, num_kv_heads, group, nb * block_size)
    pad = torch.arange(nb * block_size, device=q.device).unsqueeze(0) >= meta.seq_lens.unsqueeze(1)  # [B, K]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_seqs, num_kv_heads, group, nb, block_size)
    probs = probs.permute(0, 3, 1, 2, 4).reshape(n, num_kv_heads, group, block_size)
    out = torch.matmul(probs, v).view(num_seqs, nb, num_kv_heads, group, d).sum(dim=1)
    if not bool(torch.isfinite(out).all()):
        # a padding slot held NaN/inf (0 * NaN = NaN): zero the padding and redo. Checking the
        # small output costs far less than zeroing the padding of V on every call.
        v.view(num_seqs, nb, num_kv_heads, block_size, d).masked_fill_(pad.view(num_seqs, nb, 1, block_size, 1), 0.0)
        out = torch.matmul(probs, v).view(num_seqs, nb, num_kv_heads, group, d).sum(dim=1)
    return out.reshape(num_seqs, num_heads, d).to(q.dtype)
