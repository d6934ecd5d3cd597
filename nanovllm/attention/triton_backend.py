"""TritonBackend: the GPU attention backend (same interface as ``backends.TorchBackend``).

Pure-decode batches (every sequence has one query token) go to the paged
decode kernel, split-K when the batch is too small to fill the GPU; anything
else (prefill, chunks, mixed batches) goes to the paged prefill kernel.
A mixed step's leading decode rows (the scheduler puts running sequences
first), at least ``MIN_SPLIT_DECODES`` of them, go to the decode kernel
instead, where each costs its K/V bytes rather than a whole query tile's
arithmetic (``NANOVLLM_MIXED_DECODE_SPLIT=0`` keeps them in the prefill kernel;
about +1 % end to end on the H200, KERNEL_NOTES session 9).

CUDA-graph contract: a decode forward reads no host value but tensor shapes,
and its split-K workspace is allocated before capture (``reserve`` or an eager
warm-up at the largest batch); growing it while a graph is being captured is
an error, never a silent allocation inside the graph's pool. Once ``reserve``
has sized it, a step that asks for more is an error too: the graphs captured
before would go on reading the freed buffer.
"""

from __future__ import annotations

import os

import torch

from nanovllm.attention import decode_streamk, triton_ops
from nanovllm.attention.metadata import AttentionMetadata

# fewer leading decode rows stay in the prefill kernel (one launch); None: the split is off
MIN_SPLIT_DECODES: int | None = None if os.environ.get("NANOVLLM_MIXED_DECODE_SPLIT", "1") == "0" else 8
# the cache's storage: head-major [blocks, kv heads, slots, d] (a head's keys of a block contiguous),
# seen by the kernels through the slot-major view they address by strides; False: slot-major storage
HEAD_MAJOR_CACHE = True
# decode attention by the stream-K kernel (``decode_streamk``, KERNEL_NOTES sessions 25-26) for no
# cache ("0"), FP8 caches read as TMA boxes ("fp8", the default: a 16-bit model on a Hopper GPU, as
# measured) or every cache ("1", for experiments) ...
DECODE_STREAMK = os.environ.get("NANOVLLM_DECODE_STREAMK", "fp8")
if DECODE_STREAMK not in ("0", "fp8", "1"):
    raise ValueError(f"NANOVLLM_DECODE_STREAMK must be 0, fp8 or 1, got {DECODE_STREAMK!r}")


def _parse_batches(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi)):
        raise ValueError(f"NANOVLLM_DECODE_STREAMK_BATCHES must be LO:HI with 0 < LO <= HI, got {text!r}")
    return int(lo), int(hi)


# ... at decode batches of LO to HI rows. On an H100 (FP8 cache, Qwen3-0.6B's heads) the kernel led the
# shipped one by 5-13 % at batches 16-64, by 0.4-1.7 % at 96-160, and trailed at 8 (+19 %) and from
# 192 up; the engine gained 0.3-0.5 % with it at 16..128 (session 26)
STREAMK_BATCHES: tuple[int, int] = _parse_batches(os.environ.get("NANOVLLM_DECODE_STREAMK_BATCHES", "16:128"))


class TritonBackend:
    name = "triton"

    def __init__(self):
        self._partials: torch.Tensor | None = None  # float32 [rows * head_dim]
        self._lse: torch.Tensor | None = None  # float32 [rows]
        self._num_sms: dict[int, int] = {}
        self._reserved_rows: int | None = None  # what reserve() sized the workspace for
        self._streamk: decode_streamk.StreamKWorkspace | None = None
        self._streamk_reserved = False  # reserve() sized it: growing it later is an error

    # ----------------------------------------------------------- workspace
    def reserve(
        self,
        max_num_seqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        max_context: int | None = None,
    ) -> None:
        """Allocate the split-K workspace for every batch size up to ``max_num_seqs`` on a cache
        of ``kv_dtype`` (FP8 caches split more: ``triton_ops.num_decode_splits``). A later step
        that needs more rows raises (see the module's CUDA-graph contract). With the stream-K decode
        on for this cache and ``max_context`` (the widest block table's slots) given, its buffers
        too, for as many sequences as it takes (``STREAMK_BATCHES``) of that context; growing them
        later raises as well."""
        kv_fp8 = triton_ops.is_fp8_dtype(kv_dtype)
        self._streamk_reserved = False
        lo, hi = STREAMK_BATCHES
        if self._streamk_on(kv_fp8) and max_context is not None and max_num_seqs >= lo:
            max_tiles = -(-max_context // decode_streamk.MIN_BLOCK_N)
            group = num_heads // num_kv_heads
            self._streamk_workspace(min(max_num_seqs, hi), max_tiles, num_kv_heads, group, head_dim, device)
            self._streamk_reserved = True
        rows = max(
            num_seqs * num_heads * self.num_splits(num_seqs, num_kv_heads, device, kv_fp8=kv_fp8)
            for num_seqs in range(1, max_num_seqs + 1)
        )
        self._reserved_rows = None
        self._workspace(rows, head_dim, device)
        self._reserved_rows = rows

    def _workspace(self, rows: int, head_dim: int, device: torch.device):
        if self._reserved_rows is not None and rows > self._reserved_rows:
            raise RuntimeError(
                f"decode workspace asked for {rows} rows, more than the {self._reserved_rows} that "
                "reserve() sized it for: the CUDA graphs captured on it would read a freed buffer "
                "(reserve with the cache's dtype and the largest batch)"
            )
        have = 0 if self._lse is None else self._lse.numel()
        if have < rows or self._partials.numel() < rows * head_dim or self._lse.device != device:  # type: ignore[union-attr]
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"decode workspace must grow to {rows} rows during CUDA-graph "
                    f"capture (have {have}): call reserve() before capturing"
                )
            self._partials = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
            self._lse = torch.empty(rows, dtype=torch.float32, device=device)
        return self._partials, self._lse

    def num_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device, kv_fp8: bool = False) -> int:
        return triton_ops.num_decode_splits(num_seqs, num_kv_heads, self._sms(device), kv_fp8=kv_fp8)

    def _sms(self, device: torch.device) -> int:
        """The device's SM count (4 stands in for a CPU under Triton's interpreter)."""
        if device.type != "cuda":
            return 4
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]

    # ------------------------------------------------------------ interface
    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)  # slot-major, the view the kernels read

    @classmethod
    def new_kv_cache(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> torch.Tensor:
        """One layer's K or V cache: shaped ``kv_cache_shape``; its storage head-major when
        ``HEAD_MAJOR_CACHE`` (a strided view: one program's key tile is one contiguous run, not
        64 rows 2 KB apart; decode -1 to -2 % on the H200, KERNEL_NOTES session 9)."""
        if not HEAD_MAJOR_CACHE:
            shape = cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
            return torch.empty(shape, dtype=dtype, device=device)
        storage = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
        return storage.transpose(1, 2)

    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        triton_ops.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, k_scale, v_scale)
        n = 0  # leading decode rows for the decode kernel
        if MIN_SPLIT_DECODES is not None and meta.num_leading_decodes >= MIN_SPLIT_DECODES:
            n = meta.num_leading_decodes
        out = torch.empty_like(q)
        if n:
            self._decode(
                q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale, k_scale, v_scale, out[:n]
            )
        return triton_ops.paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc[n:],
            meta.seq_lens[n:],
            meta.block_tables[n:],
            scale,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _streamk_workspace(self, num_seqs: int, max_tiles: int, num_kv_heads: int, group: int, head_dim: int, device):
        """The stream-K buffers for ``num_seqs`` sequences of up to ``max_tiles`` key tiles (the block
        table's width), grown outside CUDA-graph capture only (the module's contract). The first
        decode of a graph's batch size is an eager warm-up at the same table width."""
        programs = self._sms(device) * decode_streamk.PROGRAMS_PER_SM  # one wave (the SM count cached)
        want = (num_seqs, max_tiles, num_kv_heads, group, head_dim, programs)
        ws = self._streamk
        if ws is None or not ws.holds(*want) or ws.lse.device != device:
            if self._streamk_reserved:
                raise RuntimeError(
                    f"stream-K decode workspace asked for {want} (sequences, tiles, KV heads, group, head_dim, "
                    f"programs), more than the {ws.size if ws else None} that reserve() sized it for: the CUDA "
                    "graphs captured on it would read a freed buffer"
                )
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"stream-K decode workspace must grow to {want} during CUDA-graph capture "
                    f"(have {ws.size if ws else None}): run a decode of this batch eagerly first"
                )
            if ws is not None and ws.size[2:5] == want[2:5]:  # the same heads: grow to cover both
                want = (max(want[0], ws.size[0]), max(want[1], ws.size[1]), *want[2:5], max(want[5], ws.size[5]))
            self._streamk = ws = decode_streamk.StreamKWorkspace.allocate(*want, device)
        return ws, programs

    @staticmethod
    def _streamk_on(kv_fp8: bool) -> bool:
        """Whether the switch may send decodes on a cache of this kind to stream-K (``reserve``
        sizes its buffers then; ``_streamk_takes`` decides per step)."""
        return DECODE_STREAMK == "1" or (DECODE_STREAMK == "fp8" and kv_fp8)

    @staticmethod
    def _streamk_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether this decode goes to stream-K: a batch within ``STREAMK_BATCHES``, and with the
        default switch ("fp8") an FP8 cache whose tiles are TMA boxes (the configuration measured)."""
        lo, hi = STREAMK_BATCHES
        if not lo <= q.shape[0] <= hi:
            return False
        if DECODE_STREAMK == "1":
            return True
        return DECODE_STREAMK == "fp8" and triton_ops.is_fp8(k_cache) and triton_ops.wants_tma(q, k_cache, v_cache)

    def _decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out=None):
        num_seqs, num_heads, head_dim = q.shape
        if self._streamk_takes(q, k_cache, v_cache):
            block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
            max_tiles = -(-block_tables.shape[1] * block_size // decode_streamk.MIN_BLOCK_N)
            workspace, programs = self._streamk_workspace(
                num_seqs, max_tiles, num_kv_heads, num_heads // num_kv_heads, head_dim, q.device
            )
            return decode_streamk.paged_decode_streamk(
                q, k_cache, v_cache, block_tables, seq_lens, scale, programs=programs, workspace=workspace,
                out=out, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        splits = self.num_splits(num_seqs, k_cache.shape[2], q.device, kv_fp8=triton_ops.is_fp8(k_cache))
        workspace = None
        if splits > 1:
            workspace = self._workspace(num_seqs * num_heads * splits, head_dim, q.device)
        return triton_ops.paged_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            num_splits=splits,
            workspace=workspace,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
