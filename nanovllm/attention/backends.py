"""Attention backends: where the device-specific choice of kernels lives."""

from __future__ import annotations

import torch

from nanovllm import cpu_kernels
from nanovllm.attention import torch_ref
from nanovllm.attention.metadata import AttentionMetadata


class TorchBackend:
    """The CPU path: cache writes and attention (decode and prefill rows alike) through the compiled
    kernels where they apply (``cpu_kernels``: float32, a C compiler); PyTorch otherwise (batched
    decode; a step with a prefill chunk through the per-sequence loop). Its cache is head-major
    (``torch_ref``'s module docstring says why)."""

    name = "torch"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    @classmethod
    def new_kv_cache(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> torch.Tensor:
        """One layer's K or V cache, contiguous in ``kv_cache_shape``."""
        return torch.empty(
            cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if cpu_kernels.applies(k, k_cache):
            return cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)
        torch_ref.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, head_major=True)

    @staticmethod
    def forward(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if cpu_kernels.applies(q, k_cache):
            rows = None if meta.is_decode_only else _prefill_rows(meta)
            return cpu_kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, rows)
        if meta.is_decode_only:
            return torch_ref.paged_decode_batched(q, k_cache, v_cache, meta, scale, k_scale, v_scale, head_major=True)
        return torch_ref.paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, head_major=True)


_rows_cache: list = []  # [meta, rows] of the last step with prefill rows (every layer gets the same meta)


def _prefill_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_rows_cache and _rows_cache[0] is meta):
        _rows_cache[:] = [meta, cpu_kernels.prefill_rows(meta.query_start_loc_cpu, meta.seq_lens_cpu)]
    return _rows_cache[1]


def get_backend(name: str):
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}")
