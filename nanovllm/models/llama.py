"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3).

The three architectures differ in a few switches (:class:`Biases`, ``qk_norm``): Qwen2 puts
a bias on the q/k/v projections; as in transformers, Llama's and Qwen3's ``attention_bias``
puts one on q, k, v *and* o, and Llama's ``mlp_bias`` one on gate, up and down; Qwen3
normalizes each head of q and k (RMSNorm) before RoPE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers import cpu_linear
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from nanovllm.layers.triton_switch import LazyKernels
from nanovllm.models import cpu_decode

# Qwen3's q/k norm + RoPE in one GPU kernel (fused_ops.qk_norm_rope); its own A/B switch on top of
# NANOVLLM_FUSED_OPS: NANOVLLM_FUSED_QK_ROPE=0 keeps the norm and RoPE kernels
fused_qk = LazyKernels("nanovllm.layers.fused_ops", "NANOVLLM_FUSED_QK_ROPE")
FUSED_KV_STORE = "NANOVLLM_FUSED_KV_STORE"  # "0": the fused q/k kernel leaves the K/V store to the backend


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_layers(config) -> list[int]:
    """The layers transformers runs with sliding-window attention (Qwen2's and Qwen3's
    ``use_sliding_window``): its ``layer_types``, or else the layers from ``max_window_layers`` on
    (transformers' default 28); none without ``use_sliding_window`` or with ``sliding_window`` null."""
    if not getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", 4096) is None:
        return []
    types = getattr(config, "layer_types", None)
    if types is None:
        return list(range(getattr(config, "max_window_layers", 28), config.num_hidden_layers))
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def make_rotary_embedding(config, max_position: int) -> RotaryEmbedding:
    theta, scaling = rope_parameters(config)
    return RotaryEmbedding(_head_dim(config), max_position, theta, scaling)


class LlamaAttention(nn.Module):
    def __init__(
        self, config, biases: Biases, qk_norm: bool, max_position: int, rotary_emb: RotaryEmbedding | None = None
    ):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=biases.qkv)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=biases.o)
        self.rotary_emb = rotary_emb or make_rotary_embedding(config, max_position)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and fused_qk.enabled(qkv):
            q, k = fused_qk.qk_norm_rope(
                positions,
                qkv,
                self.num_heads,
                self.num_kv_heads,
                (self.q_norm.weight, self.q_norm.eps),
                (self.k_norm.weight, self.k_norm.eps),
                self.rotary_emb.cos,
                self.rotary_emb.sin,
                cache=self._cache_write(meta),
            )
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # k None: already in the cache
        return self.o_proj(o.flatten(1))

    def _cache_write(self, meta: AttentionMetadata):
        """The fused q/k kernel also stores k and v where the Triton backend holds the cache
        (``NANOVLLM_FUSED_KV_STORE=0``: the backend's own store kernel, for A/B runs)."""
        if self.attn.backend.name != "triton" or os.environ.get(FUSED_KV_STORE, "1") != "1":
            return None
        a = self.attn
        return fused_qk.CacheWrite(a.k_cache, a.v_cache, meta.slot_mapping, a.k_scale, a.v_scale)


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = cpu_linear.mlp_row_tile(x)
        if rows is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return torch.cat([self.down_proj(self.act_fn(self.gate_up_proj(part))) for part in x.split(rows)])


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config, biases: Biases, qk_norm: bool, max_position: int, rotary_emb: RotaryEmbedding | None = None
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, biases, qk_norm, max_position, rotary_emb)
        self.mlp = LlamaMLP(config, biases.mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, biases: Biases, qk_norm: bool, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = make_rotary_embedding(config, max_position)  # one table for all layers (start-up)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, biases, qk_norm, max_position, rotary_emb)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        fused = cpu_decode.for_model(self, hidden, meta)  # a CPU decode step's layers in one C call
        if fused is not None:
            hidden, residual = fused.run(hidden, positions, meta)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    reads_sliding_window = False  # transformers' Llama ignores use_sliding_window; Qwen2's and Qwen3's honour it
    # checkpoint name fragment -> (our merged parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    @classmethod
    def biases(cls, config) -> Biases:
        attention, mlp = bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))
        return Biases(qkv=attention, o=attention, mlp=mlp)

    @classmethod
    def check_config(cls, config) -> None:
        """ValueError for a config field this model reads but cannot honour (before any weight or
        worker process is touched)."""
        rope_parameters(config)
        sliding = sliding_window_layers(config) if cls.reads_sliding_window else []
        if sliding:
            raise ValueError(
                f"sliding-window attention (use_sliding_window with sliding_window="
                f"{getattr(config, 'sliding_window', None)} on layers {sliding}) is not supported: "
                "every layer here attends to the whole context"
            )

    def __init__(self, config, max_position: int | None = None):
        super().__init__()
        max_position = max_position or config.max_position_embeddings
        self.model = LlamaModel(config, self.biases(config), self.qk_norm, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    reads_sliding_window = True

    @classmethod
    def biases(cls, config) -> Biases:
        return Biases(qkv=True)  # transformers' Qwen2 has neither attention_bias nor mlp_bias
