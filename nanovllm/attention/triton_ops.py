"""Triton kernels of the GPU path: store K/V, paged decode attention, paged prefill attention.

Cache layout (the same as ``torch_ref``): one tensor each for K and V per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]``, last dim contiguous; slot
``s`` is position ``s % block_size`` of block ``s // block_size``.

Invariants every kernel keeps:
- Softmax in float32 with base-2 exponentials (scores pre-multiplied by
  ``scale * log2(e)``); the output is cast to the query dtype once, at the end.
- Loop bounds come from device tensors only (``seq_lens``, ``query_start_loc``):
  a launch depends on host values only through tensor shapes, so a decode
  launch can be captured in a CUDA graph and replayed with new lengths.
- A sequence with ``seq_len == 0`` (a CUDA-graph padding row) attends to
  nothing and gets zeros, never NaN; slot -1 writes nothing.
- Query rows are packed with their KV head's whole query-head group, so each
  K/V tile is read once per group, not once per query head.
- An FP8 cache (float8 e4m3, ``KV_FP8``) holds ``clamp(x / scale, +-448)``: stores divide by
  the layer's ``k_scale``/``v_scale``, loads convert to the query dtype; ``k_scale`` is folded
  into the score scale and ``v_scale`` multiplies the output (the same values as ``torch_ref``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.layers import pdl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4: the decode kernel's TMA path stays off
    TensorDescriptor = None

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# decode programs aimed at per SM when a batch is too small to fill the GPU (num_decode_splits)
DECODE_SPLIT_WAVES = 2
# the same for FP8 caches, whose programs read half the bytes and finish sooner: at 2 waves every
# batch of 33 or more sequences got one split. Measured end to end on an H100 (KERNEL_NOTES session
# 21): 8 waves the best of 2, 3, 4, 8 and 16, +1 to +3 % over 2; 16-bit caches at 4 waves within the
# spread, so they keep 2
FP8_DECODE_SPLIT_WAVES = 8
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8 e4m3fn value (a constexpr: kernels read it)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # prefill: query rows per program (tokens x padded group); decode: unused
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    # the most registers a thread may use (ptxas' .maxnreg; None: the compiler's choice), for A/B
    # runs of occupancy: 4 CTAs of 128 threads per SM need <= 128 (the FP8 decode kernel compiles to
    # 168-184) and <= ~56 KB of shared memory each (3 stages: 41 KB; the shipped 5: 74 KB, 3 CTAs)
    maxnreg: int | None = None


TMA_BLOCK_N = 128  # the keys per TMA box of decode_config; TMA needs blocks that hold whole boxes


def decode_config(head_dim: int, dtype: torch.dtype, kv_fp8: bool = False, tma: bool = False) -> KernelConfig:
    """The decode kernel's tiles for a model ``dtype``, cache type and whether its tiles are copied
    by TMA (H200 sweeps, KERNEL_NOTES)."""
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfig(16, 32, 4, 2)
    if kv_fp8 and tma:
        # boxes of 128 keys, double-buffered (5 stages: 74 KB of shared memory, 3 CTAs per SM):
        # FP8 +3.2 % end to end against the 64-key tiles below (session 11)
        return KernelConfig(16, TMA_BLOCK_N, 4, 5)
    if kv_fp8:
        # with one block-table entry per tile and the V widening in PTX, 64-key tiles (128
        # registers, 4 CTAs per SM) beat 128-key ones (168 registers, 3 CTAs): session 4
        return KernelConfig(16, 64, 4, 3)
    # 16-bit caches (head-major storage): 128-key tiles with one block-table entry per tile read
    # 3.9-4.0 TB/s at batch 150-256 against 3.7-3.8 for 64-key tiles; the run's decode
    # attention 3.94 s against 4.19 s, +3.8 % end to end (session 10). TMA boxes lose here
    # (4.44 s against 4.20 s, session 11)
    return KernelConfig(16, 128, 4, 3)


def prefill_config(head_dim: int, dtype: torch.dtype) -> KernelConfig:
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfig(64, 32, 4, 2)
    # 64 query rows (32 tokens of a GQA-2 group), 4 warps, 3 stages: on the workload's prefill
    # steps 105 us against 126 us for 128 rows / 8 warps / 2 stages (KERNEL_NOTES session 8)
    return KernelConfig(64, 64, 4, 3)


def _widen(dtype: torch.dtype) -> bool:
    """FP8 tiles of a bfloat16 model are widened to float16 (with the query): the conversion is
    one instruction per pair instead of four, +20 % decode bandwidth on the H200 (KERNEL_NOTES);
    float16 keeps more of the query's mantissa, and attention queries sit far inside its range.
    float32 models widen to float32 (the exact-greedy tests)."""
    return dtype == torch.bfloat16


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models (the exact-greedy tests) must not silently drop to TF32
    return "ieee" if dtype == torch.float32 else "tf32"


# Metadata pointers (block tables, lengths, slots) point into the per-step staging buffer at
# offsets whose 16-byte alignment changes with the batch; Triton would compile one variant per
# alignment pattern, some of them mid-run. They are read as scalars, so alignment buys nothing:
# never specialise on it (tests/gpu/test_no_jit_after_startup.py checks no kernel compiles after
# start-up).
METADATA_PTRS = ["slot_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"]


# --------------------------------------------------------------------- store K/V
@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_cb, stride_cs):
    """Where slot ``slot`` (int64, >= 0) starts in a cache addressed by strides: its block, then its
    position in the block (shared by the store kernel and Qwen3's fused q/k kernel, which stores too)."""
    return (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs


@triton.jit
def fp8_saturate(x, scale):
    """What an FP8 cache holds for ``x``, before the cast: clamp(x / scale, +-448) in float32."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)


@triton.jit(do_not_specialize_on_alignment=METADATA_PTRS)
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_then_release(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    dst = (
        slot_offset(tl.maximum(slot, 0), BLOCK_SIZE, stride_cb, stride_cs)
        + offs_h[:, None] * stride_ch
        + offs_d[None, :]
    )
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k = fp8_saturate(k, k_scale).to(k_cache_ptr.dtype.element_ty)
        v = fp8_saturate(v, v_scale).to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key, value: [T, num_kv_heads, head_dim] (last dim contiguous); slot -1 writes nothing."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_cache(k_cache, v_cache)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        KV_FP8=is_fp8(k_cache),
        num_warps=4,
        **pdl.launch_args(key),
    )


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def is_fp8(cache: torch.Tensor) -> bool:
    return is_fp8_dtype(cache.dtype)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels' rule: one shape and dtype, K's last dim contiguous, V stored as K is."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache need one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache needs a contiguous last dim, got strides {k_cache.stride()}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache need equal strides with a contiguous last dim, got "
            f"{k_cache.stride()} and {v_cache.stride()}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache need one dtype, got {k_cache.dtype} and {v_cache.dtype}")


# ------------------------------------------------------------------------ decode
@triton.jit
def _fp8_to_f16_asm(x):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fp8_to_finite_f16_asm(x):
    """``_fp8_to_f16_asm`` with every value finite: a NaN byte becomes -65504, so a V row multiplied
    by a softmax weight of 0 adds 0. One ``max`` per pair suffices: PTX's ``max.f16x2`` returns the
    other operand when one is NaN, and e4m3fn has no infinity and nothing above 448. For
    tiles whose rows past a sequence's end are not masked (stream-K decode, where any tile may end
    an item: masking V there moves the widened tile through shared memory, 32 KB more)."""
    return _finite_f16_asm(_fp8_to_f16_asm(x))


@triton.jit
def _fp8_pairs_to_f16_asm(x, FINITE: tl.constexpr):
    """An FP8 V tile read as int16, each element a key's two neighbouring dims (2j, 2j + 1): its
    even dims and its odd dims, each widened to float16 (``V_PAIRS``). Two elements per call, as
    the MMA operand holds them (keys k and k + 1 of one dim pair): one ``prmt`` gathers the two low
    bytes and the two high bytes, one ``cvt`` widens each pair. ``FINITE``: NaN becomes -65504, as
    in ``_fp8_to_finite_f16_asm``."""
    even, odd = tl.inline_asm_elementwise(
        "{ .reg .b32 a; .reg .b16 lo, hi; prmt.b32 a, $2, 0, 0x3120; mov.b32 {lo, hi}, a; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )
    if FINITE:
        even, odd = _finite_f16_asm(even), _finite_f16_asm(odd)
    return even, odd


@triton.jit
def _finite_f16_asm(x):
    """float16 ``x`` with NaN replaced by -65504: PTX's ``max.f16x2`` returns the other operand where
    one is NaN, and nothing a widened e4m3 byte holds is below -448."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 low; mov.b32 low, 0xFBFFFBFF; max.f16x2 $0, $1, low; }",
        "=r,r",
        [x],
        dtype=tl.float16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def pairs_accumulator(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, V_PAIRS: tl.constexpr):
    """The decode tile's zero accumulator: [BLOCK_G, BLOCK_D] float32, or with ``V_PAIRS`` the
    (even dims, odd dims) pair of [BLOCK_G, BLOCK_D // 2] halves."""
    if V_PAIRS:
        acc = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32), tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    return acc


@triton.jit
def pairs_joined(acc, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, V_PAIRS: tl.constexpr):
    """The accumulator in the dims' own order: ``V_PAIRS``'s halves interleaved (dim 2j from the
    even half, 2j + 1 from the odd one); any other accumulator as it is."""
    if V_PAIRS:
        acc = tl.reshape(tl.join(acc[0], acc[1]), [BLOCK_G, BLOCK_D])
    return acc


@triton.jit
def _opaque16(x):
    """``x`` (a 16-bit tile) copied by a PTX ``mov`` marked as having side effects, so that Triton's
    search for the width an MMA operand was loaded with stops here and finds 16 bits, not the FP8
    cache's 8: the widened tile then takes the 16-bit operand layout (``kWidth`` 2), as a bf16
    cache's does. The values are unchanged, bit for bit (KERNEL_NOTES session 24)."""
    tl.static_assert(x.dtype.primitive_bitwidth == 16, "WIDE_MMA needs 16-bit tiles (a float32 model widens to 32)")
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, n0, end, table, kvh, k_cache_ptr, v_cache_ptr, k_desc, v_desc, tile_off, offs_n, offs_d,
    qk_scale, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, V_ASM: tl.constexpr, TILE_BLOCK: tl.constexpr, TMA: tl.constexpr, MASK_V: tl.constexpr,
    WIDE_MMA: tl.constexpr = 0, V_FINITE: tl.constexpr = False, V_PAIRS: tl.constexpr = False,
):  # fmt: skip
    """One key tile [n0, n0 + BLOCK_N) of the decode kernel: the online-softmax update. ``MASK_V``
    zeroes V's rows past ``end`` (NaN there would poison the product); ``V_FINITE`` (FP8 with
    ``V_ASM`` only) clamps the widened V to finite values instead, so those rows add 0 x finite.

    ``V_PAIRS`` (an FP8 cache read as TMA boxes, ``v_desc`` a view of it as int16): V's tile comes
    as [BLOCK_N, HEAD_DIM // 2] int16, each element two neighbouring dims of one key, and ``acc``
    is a pair of halves, even dims and odd dims, each its own PV product. The MMA's V operand holds
    two keys of one dim per register: from bytes, Triton gathers them one at a time (128
    ``LDS.U8`` a tile); from 16-bit elements it loads them transposed by ``ldmatrix``, and
    ``_fp8_pairs_to_f16_asm`` splits each register's dims. The FP8 loop goes from 892 to 605
    instructions (sm_90, offline; KERNEL_NOTES session 29)."""
    pos = n0 + offs_n
    n_mask = pos < end
    kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if TMA:
        # rows of HEAD_DIM elements: the block's, then the head's, then the slot's
        row = tl.load(table + n0 // BLOCK_SIZE) * (stride_cb // HEAD_DIM) + kvh * (stride_ch // HEAD_DIM)
        row += n0 % BLOCK_SIZE
        k = k_desc.load([row, 0])
    elif TILE_BLOCK:
        base = tl.load(table + n0 // BLOCK_SIZE).to(tl.int64) * stride_cb + (n0 % BLOCK_SIZE) * stride_cs
        k = tl.load(k_cache_ptr + base + tile_off, mask=kv_mask, other=0.0)
    else:
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
        if WIDE_MMA & 1:
            k = _opaque16(k)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = v_desc.load([row, 0])
    elif TILE_BLOCK:
        v = tl.load(v_cache_ptr + base + tile_off, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if V_PAIRS:
        tl.static_assert(KV_FP8 and V_ASM and TMA, "V_PAIRS reads an FP8 cache's TMA boxes as int16")
        v_even, v_odd = _fp8_pairs_to_f16_asm(v, V_FINITE)
        if MASK_V:
            v_even = tl.where(n_mask[:, None], v_even, 0.0)
            v_odd = tl.where(n_mask[:, None], v_odd, 0.0)
        p = p.to(tl.float16)
        acc_even = acc[0] * alpha[:, None] + tl.dot(p, v_even, input_precision=DOT_PRECISION)
        acc = acc_even, acc[1] * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PRECISION)
    else:
        if KV_FP8:
            if V_ASM and V_FINITE:
                v = _fp8_to_finite_f16_asm(v)
            elif V_ASM:
                v = _fp8_to_f16_asm(v)
            else:
                v = v.to(q.dtype)
            if WIDE_MMA & 2:
                v = _opaque16(v)
        if MASK_V:
            v = tl.where(n_mask[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(
    # the block-table width is the widest table of an eager step (a mixed step's decodes): one variant
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=METADATA_PTRS,
)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN: tl.constexpr,
    V_ASM: tl.constexpr = False,
    TILE_BLOCK: tl.constexpr = False,
    TMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
    WIDE_MMA: tl.constexpr = 0,
    V_PAIRS: tl.constexpr = False,
):
    """Program (seq, kv head, split): the group's query heads against keys of one split.

    ``TMA`` (with TILE_BLOCK on a head-major cache, ``k_desc``/``v_desc`` the caches' 2-D row
    views): a tile is one box of ``BLOCK_N`` rows, copied by the tensor memory accelerator.
    The box is not masked: keys past ``end`` in the tile's block are whatever the slots hold,
    so their scores are set to -inf (as always) and their V rows to zero (0 x NaN is NaN).

    ``WIDE_MMA`` (an experiment, 0 everywhere by default): the widened FP8 K (bit 1) and V (bit 2)
    tiles pass ``_opaque16`` and reach the MMA as 16-bit operands. It cuts the FP8 loop by a
    quarter offline, but at 128x4x3 it ran 6 % slower end to end on an H100 (KERNEL_NOTES
    session 24); ``ab_engine.py new,wide=3`` measures it."""
    pdl.wait_then_release(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_FP8 and WIDEN:
        q = q.to(tl.float16)  # FP8 tiles widen to float16 in one instruction per pair (bfloat16: four)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = pairs_accumulator(BLOCK_G, BLOCK_D, V_PAIRS)
    table = block_tables_ptr + seq * stride_bt
    tile_off = kvh * stride_ch + offs_n[:, None] * stride_cs + offs_d[None, :]
    # with TMA the tiles wholly inside [start, end) run unmasked (a 16-bit V stays in shared memory
    # for the MMA; an FP8 one is widened in registers either way); the last, partial one masks its
    # V rows (a box reads past the sequence's end). An empty split (end < start) gets full_end <=
    # start: Triton's integer division truncates toward zero, so no tile runs
    full_end = start + (end - start) // BLOCK_N * BLOCK_N if TMA else end
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _decode_tile(
            q, m_i, l_i, acc, n0, end, table, kvh, k_cache_ptr, v_cache_ptr, k_desc, v_desc, tile_off, offs_n,
            offs_d, qk_scale, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PRECISION,
            KV_FP8, V_ASM, TILE_BLOCK, TMA, False, WIDE_MMA, False, V_PAIRS,
        )  # fmt: skip
    if TMA:
        if full_end < end:  # the partial last tile, outside the pipelined loop
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, full_end, end, table, kvh, k_cache_ptr, v_cache_ptr, k_desc, v_desc, tile_off,
                offs_n, offs_d, qk_scale, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_N, BLOCK_SIZE,
                DOT_PRECISION, KV_FP8, V_ASM, TILE_BLOCK, TMA, True, WIDE_MMA, False, V_PAIRS,
            )  # fmt: skip

    acc = pairs_joined(acc, BLOCK_G, BLOCK_D, V_PAIRS)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range leaves acc = 0 -> zeros
    out = acc * (v_scale / l_safe)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        row = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
        tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def _merge_kernel(
    out_ptr,
    part_ptr,
    lse_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (seq, head): log-sum-exp merge of the splits; empty splits weigh 0."""
    pdl.wait_then_release(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: keep -inf - m finite
    w = tl.exp2(lse - m)  # an empty split (lse = -inf) weighs 0
    denom = tl.sum(w, 0)
    part = tl.load(
        part_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# tests and scripts (sweep_kv_fp8, ab_kernels, ab_engine) force a flag (WIDE_MMA takes 0..3)
DECODE_FLAG_OVERRIDES: dict[str, bool | int] = {}
PREFILL_FLAG_OVERRIDES: dict[str, bool] = {}  # tests and scripts/ab_kernels.py force a flag on or off


def prefill_tile_flags(block_size: int, block_n: int) -> dict[str, bool]:
    """How the prefill kernel walks its keys. SPLIT_MASK: the whole key tiles before a query
    tile's first row run without the causal and end masks (only the diagonal tiles pay them).
    TILE_BLOCK: as in decode, one block-table entry per key tile when tiles never straddle
    cache blocks (``block_size % block_n == 0``)."""
    return dict(SPLIT_MASK=True, TILE_BLOCK=block_size % block_n == 0)


def decode_tile_flags(block_size: int, block_n: int, kv_fp8: bool, dtype: torch.dtype) -> dict[str, bool]:
    """How the decode kernel addresses a K/V tile and widens an FP8 one.

    TILE_BLOCK: a tile never straddles two cache blocks (``block_size % block_n == 0``, and tiles
    start at multiples of ``block_n``), so one block-table entry per tile gives a scalar base and
    the per-key offsets are one loop-invariant int32 tile: -13 % time on the H200 for FP8 caches
    (session 4); for 16-bit caches it measured nothing on the slot-major layout (session 4) but
    +2-3 % bandwidth on the head-major one with 128-key tiles (session 10).
    V_ASM: FP8 V widens to float16 by inline PTX, four bytes per call; Triton still moves the
    widening into the MMA operand layout but packs the bytes with ``prmt``: -13 %. Both, with
    64-key tiles (``decode_config``): 231 -> 178 us at batch 256, context 1024.
    """
    return dict(
        TILE_BLOCK=block_size % block_n == 0,
        V_ASM=kv_fp8 and dtype in (torch.bfloat16, torch.float16),
    )


# which caches the decode kernel reads by TMA where it can (session 11): "fp8" (the default:
# +3.2 % end to end for FP8 caches, -4.4 % for 16-bit ones), "all" (or "1"), "0" none
DECODE_TMA = os.environ.get("NANOVLLM_DECODE_TMA", "fp8")
if DECODE_TMA not in ("fp8", "all", "1", "0"):
    raise ValueError(f"NANOVLLM_DECODE_TMA must be fp8, all, 1 or 0, got {DECODE_TMA!r}")
TMA_MAX_BOX = 256  # a TMA box's largest dimension
# an FP8 V read as TMA boxes of int16 dim pairs (``V_PAIRS`` in ``_decode_tile``, session 29): "1" (the
# default) or "0" for the byte-wise V of sessions 11-28 (A/B: ``scripts/ab_engine.py vpairs=0``)
FP8_V_PAIRS = os.environ.get("NANOVLLM_FP8_V_PAIRS", "1") == "1"


@functools.cache
def _has_tma(device_index: int) -> bool:
    """Hopper (compute capability 9.x): where the TMA path was measured; later GPUs have TMA too
    but other shared memory sizes, and stay on the plain loads until measured."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def head_major_strides(cache: torch.Tensor) -> tuple[int, ...]:
    """The strides of a ``[blocks, slots, kv heads, d]`` cache stored head-major (the engine's)."""
    num_blocks, block_size, num_kv_heads, d = cache.shape
    return (num_kv_heads * block_size * d, d, block_size * d, 1)


def _box_width(d: int) -> bool:
    """A head_dim the kernel's boxes take: a power of two up to 128 (its ``BLOCK_D``)."""
    return d <= 128 and d == triton.next_power_of_2(d)


def cache_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """A layer's cache seen as rows of ``head_dim`` elements, ``[blocks * kv heads * slots, d]``
    (row ``(block * kv_heads + head) * block_size + slot``), when a TMA box can address it: storage
    head-major and dense, ``head_dim`` a power of two up to 128 (the kernel's ``BLOCK_D``), 16-byte
    aligned, under 2**31 rows (a box's coordinates are int32); else None."""
    num_blocks, block_size, num_kv_heads, d = cache.shape
    if cache.stride() != head_major_strides(cache) or not _box_width(d):
        return None
    rows = num_blocks * num_kv_heads * block_size
    if rows >= 2**31 or cache.data_ptr() % 16 or d * cache.element_size() % 16:
        return None
    return cache.as_strided((rows, d), (d, 1))


def _tma_capable(cache: torch.Tensor) -> bool:
    if TensorDescriptor is None:
        return False
    if cache.is_cuda:
        return _has_tma(cache.device.index if cache.device.index is not None else torch.cuda.current_device())
    return os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors: only the interpreter emulates boxes


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, v_pairs: bool = False) -> tuple | None:
    """Host-side TMA descriptors of the two caches' row views, boxes of ``block_n`` keys; None
    where TMA does not apply: no descriptor support, not a Hopper GPU, a layout ``cache_rows``
    refuses, a box longer than ``TMA_MAX_BOX``. Under Triton's interpreter (CPU tensors) the
    descriptors are emulated. ``v_pairs``: V's rows seen as int16, two dims an element (``V_PAIRS``)."""
    if block_n > TMA_MAX_BOX or not _tma_capable(k_cache):
        return None
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    if k_rows is None or v_rows is None:
        return None
    if v_pairs:
        v_rows = v_rows.view(torch.int16)
    return (
        TensorDescriptor.from_tensor(k_rows, [block_n, k_rows.shape[-1]]),
        TensorDescriptor.from_tensor(v_rows, [block_n, v_rows.shape[-1]]),
    )


def wants_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``DECODE_TMA`` asks for TMA boxes for this cache and they apply: a 16-bit model,
    blocks of whole ``TMA_BLOCK_N``-key boxes, a cache ``cache_rows`` takes, on a Hopper GPU (the
    same checks as ``tma_descriptors``, so the config chosen for TMA is launched with it)."""
    asked = DECODE_TMA in ("all", "1") or (DECODE_TMA == "fp8" and is_fp8(k_cache))
    if not asked or q.dtype not in (torch.bfloat16, torch.float16) or k_cache.shape[1] % TMA_BLOCK_N:
        return False
    return _tma_capable(k_cache) and cache_rows(k_cache) is not None and cache_rows(v_cache) is not None


def num_decode_splits(
    num_seqs: int, num_kv_heads: int, num_sms: int, waves: int | None = None, kv_fp8: bool = False
) -> int:
    """Split-K factor: enough programs for ``waves`` programs per SM (default
    ``FP8_DECODE_SPLIT_WAVES`` for an FP8 cache, ``DECODE_SPLIT_WAVES`` otherwise); 1 for large
    batches.

    Depends on the batch shape only (not on lengths), so eager and graph runs agree;
    a power of two, so few kernel variants get compiled.
    """
    programs = max(1, num_seqs * num_kv_heads)
    if waves is None:
        waves = FP8_DECODE_SPLIT_WAVES if kv_fp8 else DECODE_SPLIT_WAVES
    target = waves * num_sms
    return min(MAX_SPLITS, triton.next_power_of_2(-(-target // programs)))


def decode_launch_flags(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cfg: KernelConfig, tma: bool
) -> tuple[dict[str, bool | int], tuple | None]:
    """The decode tile's flags for a launch (``decode_tile_flags``, TMA as ``wants_tma`` said,
    ``DECODE_FLAG_OVERRIDES`` last) and the TMA descriptors where the tiles are boxes (None
    otherwise; ``TMA`` then reads False): shared by ``paged_decode`` and the stream-K decode.
    ``V_PAIRS`` holds only where its tile applies, and V's descriptor is then the int16 one."""
    flags = {
        **decode_tile_flags(k_cache.shape[1], cfg.block_n, is_fp8(k_cache), q.dtype),
        "TMA": tma,
        "V_PAIRS": FP8_V_PAIRS,
        **DECODE_FLAG_OVERRIDES,
    }
    tiles = flags["TMA"] and flags["TILE_BLOCK"]
    pairs = bool(flags["V_PAIRS"]) and v_pairs_apply(
        bool(flags["V_ASM"]), is_fp8(k_cache), k_cache.shape[-1], int(flags.get("WIDE_MMA", 0))
    )
    descriptors = tma_descriptors(k_cache, v_cache, cfg.block_n, pairs) if tiles else None
    flags["TMA"] = descriptors is not None
    flags["V_PAIRS"] = pairs and flags["TMA"]  # the boxes are what V_PAIRS reads
    return flags, descriptors


def v_pairs_apply(v_asm: bool, kv_fp8: bool, head_dim: int, wide_mma: int = 0) -> bool:
    """Whether an FP8 V read as TMA boxes can be read as int16 dim pairs (``V_PAIRS``): widened by PTX
    (``V_ASM``), not the WIDE_MMA experiment's V, halves of 32 dims or more (at 16, Triton lays the
    MMA's 4 warps over the query rows, each computing the whole tile: offline, 1,001 loop
    instructions against the bytes' 474). ``scripts/sass.py`` compiles offline by the same rule."""
    return v_asm and kv_fp8 and not wide_mma & 2 and head_dim >= 64


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per sequence: q [S, num_heads, d] -> [S, num_heads, d].

    Sequence i attends to its first ``seq_lens[i]`` positions through ``block_tables[i]``.
    With ``num_splits > 1`` the keys are cut into that many ranges whose partial
    results go to ``workspace`` = (partials [>= S*num_heads*num_splits*d] float32,
    lse [>= S*num_heads*num_splits] float32), then merged. ``config`` replaces the tiles of
    ``decode_config``; K/V tiles are still copied by TMA wherever ``wants_tma`` says so (set
    ``DECODE_FLAG_OVERRIDES["TMA"] = False`` for the plain loads).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_cache(k_cache, v_cache)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = num_heads // num_kv_heads
    tma = wants_tma(q, k_cache, v_cache)
    cfg = config or decode_config(head_dim, q.dtype, is_fp8(k_cache), tma)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    rows = num_seqs * num_heads * num_splits
    if num_splits > 1:
        if workspace is None:
            workspace = (
                torch.empty(rows * head_dim, dtype=torch.float32, device=q.device),
                torch.empty(rows, dtype=torch.float32, device=q.device),
            )
        part, lse = workspace
        if part.numel() < rows * head_dim or lse.numel() < rows:
            raise ValueError(f"decode workspace too small: {rows} rows of {head_dim} needed, have {lse.numel()} rows")
    else:
        part = lse = out  # unused by the kernel
    flags, descriptors = decode_launch_flags(q, k_cache, v_cache, cfg, tma)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        *(descriptors or (k_cache, v_cache)),  # unused without TMA
        block_tables,
        seq_lens,
        out,
        part,
        lse,
        scale * LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        KV_FP8=is_fp8(k_cache),
        WIDEN=_widen(q.dtype),
        **flags,
        **pdl.launch_args(q),
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            out,
            part,
            lse,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
            **pdl.launch_args(q),
        )
    return out


@triton.jit
def _prefill_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    offs_n,
    offs_d,
    d_mask,
    q_pos,
    kv_end,
    table,
    k_cache_ptr,
    v_cache_ptr,
    qk_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    tile_off,
    kvh,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of keys from ``n0``: scores, online softmax, P @ V. MASKED: the causal and
    end-of-keys masks (the diagonal tiles); without it every key is visible to every row."""
    pos = n0 + offs_n
    n_mask = pos < kv_end
    kv_mask = n_mask[:, None] & d_mask[None, :]
    if TILE_BLOCK:  # the tile lies in one cache block: one table entry, one scalar base
        base = tl.load(table + n0 // BLOCK_SIZE).to(tl.int64) * stride_cb + (n0 % BLOCK_SIZE) * stride_cs
        k_ptrs = k_cache_ptr + base + tile_off
        v_ptrs = v_cache_ptr + base + tile_off
    else:
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        k_ptrs = k_cache_ptr + off[:, None] + offs_d[None, :]
        v_ptrs = v_cache_ptr + off[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ----------------------------------------------------------------------- prefill
@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],  # both change every step: one variant
    do_not_specialize_on_alignment=METADATA_PTRS,
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (query tile, kv head): BLOCK_Q tokens x the group's heads of one sequence.

    Sequence s owns tiles ``query_start_loc[s] // BLOCK_Q + s + (0, 1, ...)``; the
    program finds its sequence by binary search over that non-decreasing start.
    """
    pdl.wait_then_release(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = pid * 0
    hi = lo + num_seqs
    while lo + 1 < hi:  # largest s with start(s) <= pid
        mid = (lo + hi) // 2
        ok = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile < 0 or tile * BLOCK_Q >= q_len:  # tile < 0: before the first sequence of a sliced batch
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len  # cached prefix before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tile * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_FP8 and WIDEN:
        q = q.to(tl.float16)
    q_pos = ctx + tl.minimum(tok, q_len - 1)  # bottom-right causal; padding rows clamped
    kv_end = ctx + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    tile_off = kvh * stride_ch + offs_n[:, None] * stride_cs + offs_d[None, :]
    # keys before the tile's first query are visible to all its rows: whole tiles of them need
    # neither the causal mask nor the key mask (SPLIT_MASK); the first tile holds key 0, visible
    # to every row, so no row's running max stays -inf. Two loops over the same tile step, not
    # a branch inside one: each loop body is fixed at compile time, which the pipeliner needs.
    n_split = ((ctx + tile * BLOCK_Q) // BLOCK_N) * BLOCK_N if SPLIT_MASK else 0
    for n0 in range(0, n_split, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            offs_n,
            offs_d,
            d_mask,
            q_pos,
            kv_end,
            table,
            k_cache_ptr,
            v_cache_ptr,
            qk_scale,
            stride_cb,
            stride_cs,
            stride_ch,
            tile_off,
            kvh,
            BLOCK_SIZE,
            DOT_PRECISION,
            KV_FP8,
            TILE_BLOCK,
            BLOCK_D == HEAD_DIM,
            False,
        )
    for n0 in range(n_split, kv_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            offs_n,
            offs_d,
            d_mask,
            q_pos,
            kv_end,
            table,
            k_cache_ptr,
            v_cache_ptr,
            qk_scale,
            stride_cb,
            stride_cs,
            stride_ch,
            tile_off,
            kvh,
            BLOCK_SIZE,
            DOT_PRECISION,
            KV_FP8,
            TILE_BLOCK,
            BLOCK_D == HEAD_DIM,
            True,
        )
    out = acc * (v_scale / l_i)[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Packed queries of any lengths (prefill, chunks, decodes): q [T, num_heads, d] -> same.

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` (length q_i) at
    positions ``seq_lens[i] - q_i ...``; its K/V (cached prefix and this step's
    tokens, already stored) are read through ``block_tables[i]``. The metadata may be the
    tail of a larger batch's (``query_start_loc`` then starts past row 0: rows before it are
    neither read nor written; the backend gives a mixed step's leading decode rows to the
    decode kernel this way).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_cache(k_cache, v_cache)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or prefill_config(head_dim, q.dtype)
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, cfg.block_m // group_pad)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale * LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=_dot_precision(q.dtype),
        KV_FP8=is_fp8(k_cache),
        WIDEN=_widen(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **{**prefill_tile_flags(block_size, cfg.block_n), **PREFILL_FLAG_OVERRIDES},
        **pdl.launch_args(q),
    )
    return out


def decode_kv_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """K/V bytes a decode step must read (the bandwidth denominator of the micro-benchmark)."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem_size


__all__ = [
    "KernelConfig",
    "decode_config",
    "prefill_config",
    "store_kv",
    "paged_decode",
    "paged_prefill",
    "num_decode_splits",
    "decode_kv_bytes",
    "MAX_SPLITS",
    "DECODE_SPLIT_WAVES",
    "FP8_DECODE_SPLIT_WAVES",
]
