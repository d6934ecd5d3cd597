"""Paged attention in plain PyTorch: the CPU path and the oracle for GPU kernels.

Cache layout, one tensor each for K and V per layer: [num_blocks, block_size,
num_kv_heads, head_dim] (slot-major: the GPU kernels' layout, and the oracle's default); slot s
is position ``s % block_size`` of block ``s // block_size``. The CPU backend keeps its own cache
head-major, [num_blocks, num_kv_heads, block_size, head_dim] (``head_major=True``): a block's
keys of one head are then one contiguous [block_size, head_dim] matrix, so the decode path's
block gather is a plain copy of whole blocks instead of a transposing one (1.4-1.7x faster
decode attention on the development machine; the results are bitwise the same). Softmax is
computed in float32.

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
    head_major: bool = False,
) -> None:
    """Write each new token's K/V into its slot; slot -1 writes nothing."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if k_cache.dtype == FP8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    if head_major:  # [num_blocks, kv_heads, block_size, d]: token t goes to [block, :, offset]
        block_size = k_cache.shape[2]
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        _bytes(k_cache)[block, :, offset] = _bytes(key)
        _bytes(v_cache)[block, :, offset] = _bytes(value)
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    _bytes(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _bytes(key))
    _bytes(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _bytes(value))


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float = 1.0, head_major: bool = False
) -> torch.Tensor:
    """The first ``seq_len`` positions of one sequence: [seq_len, num_kv_heads, head_dim], float32
    (a strided view of a head-major gather: ``attention_one_seq`` takes the heads first anyway)."""
    block_size = cache.shape[2 if head_major else 1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = _bytes(cache).index_select(0, block_table[:num_blocks].long())
    if head_major:  # [n, kvh, bs, d] -> [kvh, n * bs, d] -> [seq_len, kvh, d]
        blocks = blocks.transpose(0, 1).flatten(1, 2).transpose(0, 1)
    else:
        blocks = blocks.flatten(0, 1)
    return _load(blocks[:seq_len], cache.dtype, scale)


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
    head_major: bool = False,
) -> torch.Tensor:
    """The oracle: one sequence at a time, K/V read through the block table."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        s, e = starts[i], starts[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, k_scale, head_major)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, v_scale, head_major)
        out[s:e] = attention_one_seq(q[s:e], k, v, scale)
    return out


def _decode_plan(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the blocks the sequences use (sequence 0's in order, then sequence 1's, ...): their cache
    block ids, the sequence each belongs to, and which of its slots lie past the sequence's length.
    Built once per step (every layer gets the same ``meta``)."""
    if _plan_cache and _plan_cache[0] is meta:
        return _plan_cache[1]
    lens = meta.seq_lens_cpu
    nbs = torch.tensor([cdiv(n, block_size) for n in lens])
    nb = int(nbs.max())
    used = torch.arange(nb).unsqueeze(0) < nbs.unsqueeze(1)  # [B, nb]
    seq_of_block = torch.repeat_interleave(torch.arange(len(lens)), nbs)
    first_pos = (torch.arange(nb) * block_size).unsqueeze(0).expand(len(lens), nb)[used]
    pad = first_pos.unsqueeze(1) + torch.arange(block_size) >= torch.tensor(lens)[seq_of_block].unsqueeze(1)
    device = meta.block_tables.device
    table = meta.block_tables[:, :nb][used.to(device)].long()
    plan = (table, seq_of_block.to(device), pad.to(device))
    _plan_cache[:] = [meta, plan]
    return plan


_plan_cache: list = []  # [meta, plan] of the last decode step


def paged_decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    head_major: bool = False,
) -> torch.Tensor:
    """One query per sequence, all sequences at once: the CPU decode path.

    Only the blocks a sequence uses are gathered (no padding to the longest sequence), as
    [kv_head, slot, d] (a plain copy from a head-major cache, a transposing one from a slot-major
    cache), so both products are batched matmuls over blocks. The softmax runs over each sequence's blocks: its maximum and denominator are
    reduced per sequence (``scatter_reduce_``/``index_add_``, in block order), and the
    unnormalised block outputs are summed per sequence, then divided by the denominator. A
    sequence's result depends only on its own blocks, never on its batch-mates. Slots past
    ``seq_len`` are masked (and their V zeroed when they hold NaN or inf: never-written slots
    may, and 0 * NaN is NaN).
    """
    num_seqs, num_heads, d = q.shape
    if head_major:
        _, num_kv_heads, block_size, _ = k_cache.shape
        k_blocks, v_blocks = _bytes(k_cache), _bytes(v_cache)
    else:
        _, block_size, num_kv_heads, _ = k_cache.shape
        k_blocks, v_blocks = _bytes(k_cache).permute(0, 2, 1, 3), _bytes(v_cache).permute(0, 2, 1, 3)
    group = num_heads // num_kv_heads
    table, seq_of_block, pad = _decode_plan(meta, block_size)
    n = table.numel()
    k = _load(k_blocks.index_select(0, table), k_cache.dtype, k_scale)  # [n, kvh, bs, d]
    v = _load(v_blocks.index_select(0, table), v_cache.dtype, v_scale)
    qb = q.float().view(num_seqs, num_kv_heads, group, d).index_select(0, seq_of_block)  # [n, kvh, g, d]
    scores = torch.matmul(qb, k.transpose(-1, -2)).mul_(scale)  # [n, kvh, g, bs]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    by_seq = seq_of_block[:, None, None].expand(n, num_kv_heads, group)
    peak = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=q.device)
    peak.scatter_reduce_(0, by_seq, scores.amax(dim=-1), "amax")
    weights = scores.sub_(peak.index_select(0, seq_of_block).unsqueeze(-1)).exp_()  # masked slots: 0
    denom = torch.zeros_like(peak).index_add_(0, seq_of_block, weights.sum(dim=-1))

    def combine(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_seqs, num_kv_heads, group, d, device=q.device)
        return out.index_add_(0, seq_of_block, torch.matmul(weights, v)).div_(denom.unsqueeze(-1))

    out = combine(v)
    if not bool(torch.isfinite(out).all()):
        # a padding slot held NaN/inf (0 * NaN = NaN): zero the padding and redo. Checking the
        # small output costs far less than zeroing the padding of V on every call.
        v.masked_fill_(pad[:, None, :, None], 0.0)
        out = combine(v)
    return out.reshape(num_seqs, num_heads, d).to(q.dtype)
