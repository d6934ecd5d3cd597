"""The attention layer: write this step's K/V into the paged cache, then attend.

The cache tensors and the backend (torch reference or Triton) are attached by
the ModelRunner after it sizes the cache; the metadata comes with each call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        # an FP8 cache stores x / scale (vLLM's per-layer k_scale, v_scale); 1.0 as in vLLM when the
        # checkpoint gives none. Python floats: constant for the engine's life, so graphs keep them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.backend: Any = None  # the runner sets it

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] -> [T, heads, d]. k None: the caller's kernel
        already wrote this step's k and v into the cache (Qwen3's fused q/k kernel on the GPU)."""
        if k is not None:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)
