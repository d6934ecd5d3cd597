"""Who writes a step's K and V: with the Triton backend, Qwen3's fused q/k kernel (a ``CacheWrite``
handed to it, and ``Attention`` told so by ``k=None``); with the torch backend, or with
``NANOVLLM_FUSED_KV_STORE=0``, the backend's store. A routing slip would not show in any output
(the other path stores the same values): only here, and in the launch count on a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen3Config

pytest.importorskip("triton", reason="CacheWrite lives in the Triton kernels' module")

from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.layers.attention import Attention  # noqa: E402
from nanovllm.layers.fused_ops import CacheWrite  # noqa: E402
from nanovllm.models.llama import LlamaAttention  # noqa: E402

CONFIG = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32)


class RecordingBackend:
    def __init__(self, name: str):
        self.name = name
        self.stored = 0

    def store_kv(self, *args):
        self.stored += 1

    def forward(self, q, *args):
        return torch.zeros_like(q)


def _layer(backend_name: str) -> LlamaAttention:
    layer = LlamaAttention(CONFIG, types.SimpleNamespace(qkv=False, o=False), qk_norm=True, max_position=64)
    layer.attn.backend = RecordingBackend(backend_name)
    layer.attn.k_cache, layer.attn.v_cache = torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)
    layer.attn.k_scale, layer.attn.v_scale = 0.5, 2.0
    return layer


def _meta() -> AttentionMetadata:
    return types.SimpleNamespace(slot_mapping=torch.arange(3))  # _cache_write reads only the slots


def test_the_triton_backend_gets_the_cache_write_by_default(monkeypatch):
    monkeypatch.delenv("NANOVLLM_FUSED_KV_STORE", raising=False)
    layer, meta = _layer("triton"), _meta()
    write = layer._cache_write(meta)
    assert isinstance(write, CacheWrite)
    assert write.k_cache is layer.attn.k_cache and write.v_cache is layer.attn.v_cache
    assert write.slot_mapping is meta.slot_mapping and (write.k_scale, write.v_scale) == (0.5, 2.0)


@pytest.mark.parametrize("backend,switch", [("torch", None), ("triton", "0")])
def test_the_backend_stores_elsewhere(monkeypatch, backend, switch):
    if switch is None:
        monkeypatch.delenv("NANOVLLM_FUSED_KV_STORE", raising=False)
    else:
        monkeypatch.setenv("NANOVLLM_FUSED_KV_STORE", switch)
    assert _layer(backend)._cache_write(_meta()) is None


def test_attention_stores_only_what_was_not_stored():
    attn = Attention(num_heads=4, head_dim=16, scale=0.25, num_kv_heads=2)
    attn.backend = RecordingBackend("triton")
    q, kv = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16)
    attn(q, None, kv, _meta())
    assert attn.backend.stored == 0
    attn(q, kv, kv, _meta())
    assert attn.backend.stored == 1
