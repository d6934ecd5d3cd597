"""The physical limit of a workload on a GPU: prefill FLOPs at the matmul rate plus decode
bytes (weights once per step, every sequence's K/V once per step) at memory bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.bench.workloads import Workload

# measured on the H200 machine: bf16 matmul on random data, device copy r+w
H200_BF16_FLOPS = 790e12
H200_HBM_BYTES_PER_S = 4.3e12


@dataclass
class Roofline:
    prefill_flops: float
    decode_weight_bytes: float
    decode_kv_bytes: float
    seconds: float
    output_tokens_per_s: float

    def describe(self) -> str:
        return (
            f"prefill {self.prefill_flops / 1e12:.0f} TFLOP, decode weights {self.decode_weight_bytes / 1e12:.2f} TB "
            f"+ K/V {self.decode_kv_bytes / 1e12:.1f} TB -> {self.seconds:.2f} s, "
            f"{self.output_tokens_per_s:,.0f} output tok/s"
        )


def roofline(
    w: Workload,
    shape: dict,
    dtype_bytes: int = 2,
    flops: float = H200_BF16_FLOPS,
    bandwidth: float = H200_HBM_BYTES_PER_S,
    tp: int = 1,
    kv_bytes_per_elem: int | None = None,
) -> Roofline:
    """``kv_bytes_per_elem``: what the KV cache stores per element (1 for an FP8 cache; default:
    the weights' ``dtype_bytes``)."""
    H, L, I, V = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]  # noqa: E741
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    layer_params = H * (q + 2 * kv) + q * H + 3 * H * I
    body = L * layer_params
    head = V * H
    prefill = sum(2 * body * len(p) + 4 * L * q * len(p) * (len(p) + 1) / 2 + 2 * head for p in w.prompts)
    steps = max(w.max_tokens) - 1  # the first output token comes from the prefill
    weight_bytes = (body + head) * dtype_bytes * steps
    kv_per_token = 2 * L * kv * (dtype_bytes if kv_bytes_per_elem is None else kv_bytes_per_elem)
    kv_bytes = sum(kv_per_token * sum(len(p) + t for t in range(1, n)) for p, n in zip(w.prompts, w.max_tokens))
    seconds = prefill / (flops * tp) + (weight_bytes + kv_bytes) / (bandwidth * tp)
    return Roofline(prefill, weight_bytes, kv_bytes, seconds, w.num_output_tokens / seconds)
