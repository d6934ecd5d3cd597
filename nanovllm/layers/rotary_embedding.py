"""Rotary position embedding (the "neox" half-rotation layout HF Llama/Qwen use), with the
default, linear and llama3 scalings; any other is refused when the model is loaded."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanovllm import cpu_kernels
from nanovllm.layers.triton_switch import LazyKernels

# the RoPE scaling types we implement, with the fields each needs (transformers' names and formulas)
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

fused_ops = LazyKernels("nanovllm.layers.fused_ops", "NANOVLLM_FUSED_OPS")  # Triton only when used


def rope_type(rope_scaling: dict | None) -> str:
    scaling = rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(rope_scaling: dict | None) -> None:
    """ValueError naming the field unless ``rope_scaling`` is one we implement exactly (yarn, dynamic,
    longrope, ... change the attention too: refused rather than run wrong)."""
    kind = rope_type(rope_scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in ROPE_TYPES[kind] if k not in rope_scaling]  # type: ignore[operator]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {', '.join(missing)} (got {rope_scaling})")
    partial = (rope_scaling or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"rope_scaling partial_rotary_factor={partial} is not supported (only 1.0)")


def rope_parameters(config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of an HF config, from transformers 4.x (rope_theta, rope_scaling) or
    5.x (rope_parameters) fields; ValueError for a scaling we do not implement."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None)
    if scaling is None and rope_type(params) != "default":
        scaling = params
    check_rope_scaling(scaling)
    return float(theta), scaling


def _inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    check_rope_scaling(rope_scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(rope_scaling)
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]  # type: ignore[index]
    if kind == "llama3":
        factor = rope_scaling["factor"]  # type: ignore[index]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]  # type: ignore[index]
        old_len = rope_scaling["original_max_position_embeddings"]  # type: ignore[index]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last CPU step

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def _half_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions``, first half only (the table repeats itself: cat(freqs, freqs)),
        [T, 1, head_dim / 2]. On CPU the last step's pair is kept: every layer of a step passes the
        same ``positions`` tensor, so the gather runs once per step, not once per layer."""
        cached = self._last
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        half = self.head_dim // 2
        cos = self.cos[positions, :half].unsqueeze(1).to(dtype)
        sin = self.sin[positions, :half].unsqueeze(1).to(dtype)
        if positions.device.type == "cpu":
            self._last = (positions, dtype, cos, sin)
        return cos, sin

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` half by half, into one new tensor: the same products and
        sums (x1*cos + (-x2)*sin is x1*cos - x2*sin exactly), without the concatenated copies."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=o1).sub_(x2 * sin)
        torch.mul(x2, cos, out=o2).add_(x1 * sin)
        return out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]."""
        if fused_ops.enabled(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            fused_ops.rotary_(positions, q, k, self.cos, self.sin)  # in place
            return q, k
        if cpu_kernels.elementwise_applies(q, k, self.cos) and q.dim() == 3:
            cpu_kernels.rotary_neox_(positions, q, k, self.cos, self.sin)  # in place, bitwise the PyTorch path
            return q, k
        cos, sin = self._half_tables(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
