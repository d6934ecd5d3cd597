"""The physical limit of a workload on a GPU: prefill FLOPs at the matmul rate plus decode
bytes (weights once per step, every sequence's K/V once per step) at memory bandwidth.

The two rates are the device's own, measured (``scripts/hbm_bandwidth.py --matmul``): a limit
computed with another GPU's rates would misstate the fraction a run reaches."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.bench.workloads import Workload


@dataclass(frozen=True)
class DeviceLimits:
    """A GPU's measured rates: a bf16 matmul on random data, and ``copy_`` (read + write bytes)."""

    name: str  # ``torch.cuda.get_device_name()``, exactly: an H100 PCIe or NVL streams otherwise
    bf16_flops: float
    hbm_bytes_per_s: float
    measured: str  # when and how


H200 = DeviceLimits("NVIDIA H200", 790e12, 4.3e12, "2026-11-30: bf16 matmul; copy_ read + write")
H100 = DeviceLimits(
    "NVIDIA H100 80GB HBM3",
    780e12,  # a limit takes the best rate measured (8,192 and 16,384 square: 678 / 684)
    3.01e12,
    "2026-12-05: bf16 matmul 4,096 square 780 TFLOP/s; copy_ read + write of 2 and 8 GiB 3.01 TB/s "
    "(scripts/hbm_bandwidth.py --gib 2 8 --matmul)",
)
KNOWN_DEVICES = (H200, H100)


def device_limits(device_name: str) -> DeviceLimits | None:
    """The measured limits of the GPU ``torch.cuda.get_device_name()`` calls ``device_name``;
    None for a GPU not measured."""
    for d in KNOWN_DEVICES:
        if d.name == device_name.strip():
            return d
    return None


@dataclass
class Roofline:
    prefill_flops: float
    decode_weight_bytes: float
    decode_kv_bytes: float
    seconds: float
    output_tokens_per_s: float
    device: DeviceLimits

    def describe(self) -> str:
        d = self.device
        return (
            f"{d.name.removeprefix('NVIDIA ')}: prefill {self.prefill_flops / 1e12:.0f} TFLOP at {d.bf16_flops / 1e12:.0f} TFLOP/s, "
            f"decode weights {self.decode_weight_bytes / 1e12:.2f} TB + K/V {self.decode_kv_bytes / 1e12:.1f} TB "
            f"at {d.hbm_bytes_per_s / 1e12:.2f} TB/s -> {self.seconds:.2f} s, {self.output_tokens_per_s:,.0f} output tok/s"
        )


def roofline(
    w: Workload,
    shape: dict,
    device: DeviceLimits,
    dtype_bytes: int = 2,
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
    seconds = prefill / (device.bf16_flops * tp) + (weight_bytes + kv_bytes) / (device.hbm_bytes_per_s * tp)
    return Roofline(prefill, weight_bytes, kv_bytes, seconds, w.num_output_tokens / seconds, device)
