"""Decode attention with a fixed grid that walks all key tiles, stream-K style (KERNEL_NOTES session 25).

The shipped decode kernel (``triton_ops.paged_decode``) runs one program per (sequence, KV head,
split). At the run's middle batches each program walks ~4 key tiles, and on an H100 a program's
start and end (its query, block table, first TMA round trip, its partial) cost ~4.7 us, about one
tile's time: a fifth of the kernel at batch 129 (session 25's counters). Here the tiles of all
(sequence, KV head) items are laid end to end, sequence-major, and a fixed number of programs each
take one consecutive share of them, whatever items it crosses:

1. ``_tile_map_kernel`` (one program per sequence) writes each tile's (item, tile index) and each
   item's first tile, and the total.
2. ``_decode_streamk_kernel`` (``programs`` programs) walks its share. At an item's first tile (or
   its own first) it loads the item's query and resets the online softmax; at an item's last tile
   (or its own last) it writes a partial (output and log-sum-exp) to slot ``item + program``, a
   masked store. The tile map, lengths, block-table entries and K/V boxes are loaded ahead by the
   pipeliner, across item boundaries; the query's load sits under a branch, so it is not (its
   buffers would cost 8 KB of shared memory).
3. ``_streamk_merge_kernel`` (one program per sequence and query head) merges an item's partials.

Slots: from one tile to the next the item and the program each grow or stay (items of no tiles are
skipped), and at a new (item, program) pair at least one grows, so ``item + program`` never repeats;
``items + programs`` slots hold them all.

On by default for FP8 caches read as TMA boxes (a 16-bit model on a Hopper GPU) at decode batches
of 16 to 128 rows (``triton_backend.DECODE_STREAMK`` and ``STREAMK_BATCHES``, set by
``NANOVLLM_DECODE_STREAMK=0|fp8|1`` and ``NANOVLLM_DECODE_STREAMK_BATCHES=LO:HI``). On an H100 it led
the shipped kernel by 5-13 % at batches 16-64 and trailed it at 8 and from 192 up; the engine's FP8
runs gained 0.3-0.5 % (KERNEL_NOTES session 26). ``ab_engine.py streamk=0`` A/Bs it,
``scripts/ncu_decode.py --tile streamk`` times the kernels on a GPU, and ``scripts/sass.py --kernel
shipped,streamk`` compares their loops offline.

The tiles are those of ``paged_decode`` (``_decode_tile``). Any tile may end an item, so none can
skip the treatment of keys past a sequence's end: their scores are -inf as always, and V's rows
there must add nothing (0 x NaN is NaN):
- tiles loaded with a mask (caches read without TMA, 16-bit ones above all) are zero there already;
- a TMA box is not masked: a 16-bit V is zeroed in registers, an FP8 one widened by PTX is clamped
  to finite values instead (``V_FINITE``). Zeroing a tile in registers moves it through shared
  memory: 102-110 KB instead of 74, 2 CTAs per SM instead of 3.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.attention import triton_ops as ops
from nanovllm.layers import pdl

# the most programs per SM the FP8 tiles leave room for (3 CTAs of 74 KB of shared memory and 168
# registers each): a grid of this many per SM runs in one wave
PROGRAMS_PER_SM = 3
# registers per thread: the shipped FP8 decode kernel's own count, so 3 CTAs of 128 threads fit an
# SM. Uncapped, the stream-K kernel compiles to 223 (FP8 boxes) and 202 (bfloat16, masked loads) on
# sm_90 offline, room for 2 CTAs. At 168 the FP8 kernel spills nothing; the bfloat16 one keeps 24
# bytes on its stack, read back 6 times a tile and stored outside the loop (``register_cap``).
MAXNREG = 168
MIN_BLOCK_N = 32  # the fewest keys a decode tile holds (float32 models): sizes the tile map


@dataclass
class StreamKWorkspace:
    """Device buffers of one stream-K decode: sized for up to ``num_seqs`` sequences of at most
    ``max_tiles`` key tiles each, ``num_kv_heads`` KV heads of ``group`` query heads of
    ``head_dim``, and up to ``programs`` programs (``size``). With the switch on, the tile map is the
    big one: ``num_seqs x num_kv_heads x max_tiles`` int64 (Qwen3-0.6B, 256 sequences of 40,960
    slots in 32-key tiles: 21 MB)."""

    size: tuple[int, int, int, int, int, int]  # (num_seqs, max_tiles, num_kv_heads, group, head_dim, programs)
    tile_map: torch.Tensor  # int64 [tiles]: item << 32 | tile index within the item
    item_start: torch.Tensor  # int32 [items + 1]: an item's first tile; the last entry the total
    num_tiles: torch.Tensor  # int32 [1]
    partials: torch.Tensor  # float32 [(items + programs) * group * head_dim]
    lse: torch.Tensor  # float32 [(items + programs) * group]

    @classmethod
    def allocate(
        cls, num_seqs: int, max_tiles: int, num_kv_heads: int, group: int, head_dim: int, programs: int, device
    ) -> StreamKWorkspace:
        items = num_seqs * num_kv_heads
        slots = items + programs
        return cls(
            size=(num_seqs, max_tiles, num_kv_heads, group, head_dim, programs),
            tile_map=torch.empty(max(1, items * max_tiles), dtype=torch.int64, device=device),
            item_start=torch.empty(items + 1, dtype=torch.int32, device=device),
            num_tiles=torch.empty(1, dtype=torch.int32, device=device),
            partials=torch.empty(slots * group * head_dim, dtype=torch.float32, device=device),
            lse=torch.empty(slots * group, dtype=torch.float32, device=device),
        )

    def holds(self, num_seqs: int, max_tiles: int, num_kv_heads: int, group: int, head_dim: int, programs: int) -> bool:
        """Whether a decode of this shape fits: the same heads, no more of the rest."""
        seqs, tiles, kv_heads, g, d, progs = self.size
        return (kv_heads, g, d) == (num_kv_heads, group, head_dim) and (
            num_seqs <= seqs and max_tiles <= tiles and programs <= progs
        )


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _tile_map_kernel(
    seq_lens_ptr,
    tile_map_ptr,
    item_start_ptr,
    num_tiles_ptr,
    num_seqs,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (seq): the tiles of the sequence's KV heads, after those of the sequences before it."""
    pdl.wait_then_release(PDL)
    seq = tl.program_id(0)
    before = 0  # tiles of one head of every earlier sequence
    for s0 in range(0, num_seqs, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < seq, other=0)
        before += tl.sum((lens + BLOCK_N - 1) // BLOCK_N)
    tiles = (tl.load(seq_lens_ptr + seq) + BLOCK_N - 1) // BLOCK_N
    base = before * NUM_KV_HEADS
    for h in tl.static_range(NUM_KV_HEADS):
        item = seq * NUM_KV_HEADS + h
        start = base + h * tiles
        tl.store(item_start_ptr + item, start)
        for j0 in range(0, tiles, BLOCK_T):
            offs_t = j0 + tl.arange(0, BLOCK_T)
            tl.store(tile_map_ptr + start + offs_t, (item.to(tl.int64) << 32) | offs_t, mask=offs_t < tiles)
    if seq == num_seqs - 1:
        tl.store(num_tiles_ptr, base + NUM_KV_HEADS * tiles)
        tl.store(item_start_ptr + num_seqs * NUM_KV_HEADS, base + NUM_KV_HEADS * tiles)


@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=ops.METADATA_PTRS + ["tile_map_ptr", "num_tiles_ptr"],
)
def _decode_streamk_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    block_tables_ptr,
    seq_lens_ptr,
    tile_map_ptr,
    num_tiles_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
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
    NUM_KV_HEADS: tl.constexpr,
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
    """Program p: tiles [p * share, (p + 1) * share) of all items' tiles, share = cdiv(total, programs)."""
    pdl.wait_then_release(PDL)
    pid = tl.program_id(0)
    total = tl.load(num_tiles_ptr)
    share = tl.maximum(tl.cdiv(total, tl.num_programs(0)), 1)  # no tile at all (padding only): no division by 0
    t0 = pid * share
    t1 = tl.minimum(t0 + share, total)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_dtype = tl.float16 if KV_FP8 and WIDEN else q_ptr.dtype.element_ty
    q = tl.zeros([BLOCK_G, BLOCK_D], q_dtype)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = ops.pairs_accumulator(BLOCK_G, BLOCK_D, V_PAIRS)
    for t in range(t0, t1):
        info = tl.load(tile_map_ptr + t)
        item = (info >> 32).to(tl.int32)
        j = (info & 0xFFFFFFFF).to(tl.int32)
        seq = item // NUM_KV_HEADS
        kvh = item % NUM_KV_HEADS
        seq_len = tl.load(seq_lens_ptr + seq)
        n0 = j * BLOCK_N
        first = (j == 0) | (t == t0)
        if first:  # a load under a branch is not pipelined: no shared-memory buffers for q
            heads = kvh * GROUP + offs_g
            q = tl.load(
                q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(q_dtype)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = ops.pairs_accumulator(BLOCK_G, BLOCK_D, V_PAIRS)
        table = block_tables_ptr + seq * stride_bt
        tile_off = kvh * stride_ch + offs_n[:, None] * stride_cs + offs_d[None, :]
        m_i, l_i, acc = ops._decode_tile(
            q, m_i, l_i, acc, n0, seq_len, table, kvh, k_cache_ptr, v_cache_ptr, k_desc, v_desc, tile_off, offs_n,
            offs_d, qk_scale, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PRECISION,
            KV_FP8, V_ASM, TILE_BLOCK, TMA, TMA and not (KV_FP8 and V_ASM), WIDE_MMA, KV_FP8 and V_ASM, V_PAIRS,
        )  # fmt: skip
        if (n0 + BLOCK_N >= seq_len) | (t == t1 - 1):  # the item's last tile or the program's
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            row = (item + pid) * GROUP + offs_g
            tl.store(
                part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                ops.pairs_joined(acc, BLOCK_G, BLOCK_D, V_PAIRS) * (v_scale / l_safe)[:, None],
                mask=g_mask[:, None] & d_mask[None, :],
            )
            tl.store(lse_ptr + row, m_i + tl.log2(l_safe), mask=g_mask)


@triton.jit(do_not_specialize_on_alignment=["item_start_ptr", "num_tiles_ptr"])
def _streamk_merge_kernel(
    out_ptr,
    part_ptr,
    lse_ptr,
    item_start_ptr,
    num_tiles_ptr,
    stride_ot,
    stride_oh,
    programs,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (seq, query head): the log-sum-exp merge of its item's partials, one per program that
    walked some of the item's tiles; an item of no tiles (a padding row) gives zeros."""
    pdl.wait_then_release(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    item = seq * NUM_KV_HEADS + head // GROUP
    g = head % GROUP
    share = tl.maximum(tl.cdiv(tl.load(num_tiles_ptr), programs), 1)
    start = tl.load(item_start_ptr + item)
    end = tl.load(item_start_ptr + item + 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first_p = start // share
    count = tl.where(end > start, (end - 1) // share - first_p + 1, 0)  # no negative division
    m = float("-inf")
    weight = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p in range(first_p, first_p + count):
        row = (item + p) * GROUP + g
        lse = tl.load(lse_ptr + row)
        m_new = tl.maximum(m, lse)  # finite: every partial covers at least one key
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * tl.load(part_ptr + row * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        weight = weight * alpha + w
        m = m_new
    out = acc / tl.where(weight > 0, weight, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def register_cap(kv_fp8: bool, itemsize: int, tma: bool) -> int | None:
    """``MAXNREG`` where the tiles fit 3 CTAs per SM: FP8 caches, and 16-bit ones (``itemsize`` 2)
    read by masked loads. A 16-bit cache read as TMA boxes zeroes V in registers (102 KB of shared
    memory, 2 CTAs either way; capped, it spills), and float32 tiles are another shape: neither is
    capped. ``scripts/sass.py`` compiles offline with the same cap."""
    if kv_fp8 or (itemsize == 2 and not tma):
        return MAXNREG
    return None


def default_programs(device: torch.device) -> int:
    """One wave of programs: ``PROGRAMS_PER_SM`` per SM (4 SMs stand in for a CPU's interpreter)."""
    if device.type != "cuda":
        return 4 * PROGRAMS_PER_SM
    return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def paged_decode_streamk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    programs: int | None = None,
    workspace: StreamKWorkspace | None = None,
    out: torch.Tensor | None = None,
    config: ops.KernelConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``triton_ops.paged_decode``'s result (one query token per sequence, q [S, heads, d]) from
    ``programs`` programs that share all key tiles (default ``default_programs``). ``workspace``:
    sized for this batch (``StreamKWorkspace.allocate``; allocated here when None, with room for
    contexts up to the block tables' width)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    ops.check_cache(k_cache, v_cache)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    programs = programs or default_programs(q.device)
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    tma = ops.wants_tma(q, k_cache, v_cache)
    cfg = config or ops.decode_config(head_dim, q.dtype, ops.is_fp8(k_cache), tma)
    cap = register_cap(ops.is_fp8(k_cache), k_cache.element_size(), tma)
    if config is None and cap is not None:
        cfg = dataclasses.replace(cfg, maxnreg=cap)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if workspace is None:
        max_tiles = -(-block_tables.shape[1] * block_size // cfg.block_n)
        workspace = StreamKWorkspace.allocate(num_seqs, max_tiles, num_kv_heads, group, head_dim, programs, q.device)
    max_tiles = -(-block_tables.shape[1] * block_size // cfg.block_n)
    want = (num_seqs, max_tiles, num_kv_heads, group, head_dim, programs)
    if not workspace.holds(*want):
        raise ValueError(
            f"stream-K workspace of {workspace.size} does not hold (num_seqs, max_tiles, num_kv_heads, group, "
            f"head_dim, programs) = {want}"
        )
    launch = pdl.launch_args(q)
    _tile_map_kernel[(num_seqs,)](
        seq_lens,
        workspace.tile_map,
        workspace.item_start,
        workspace.num_tiles,
        num_seqs,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_N=cfg.block_n,
        BLOCK_S=256,
        BLOCK_T=64,
        num_warps=4,
        **launch,
    )
    flags, descriptors = ops.decode_launch_flags(q, k_cache, v_cache, cfg, tma)
    _decode_streamk_kernel[(programs,)](
        q,
        k_cache,
        v_cache,
        *(descriptors or (k_cache, v_cache)),  # unused without TMA
        block_tables,
        seq_lens,
        workspace.tile_map,
        workspace.num_tiles,
        workspace.partials,
        workspace.lse,
        scale * ops.LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
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
        NUM_KV_HEADS=num_kv_heads,
        DOT_PRECISION=ops._dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        KV_FP8=ops.is_fp8(k_cache),
        WIDEN=ops._widen(q.dtype),
        **flags,
        **launch,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )
    _streamk_merge_kernel[(num_seqs, num_heads)](
        out,
        workspace.partials,
        workspace.lse,
        workspace.item_start,
        workspace.num_tiles,
        out.stride(0),
        out.stride(1),
        programs,
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **launch,
    )
    return out
