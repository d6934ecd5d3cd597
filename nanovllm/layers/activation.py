import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import cpu_kernels
from nanovllm.layers.triton_switch import LazyKernels

fused_ops = LazyKernels("nanovllm.layers.fused_ops", "NANOVLLM_FUSED_OPS")  # Triton only when used


class SiluAndMul(nn.Module):
    """silu(gate) * up, for the merged [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.enabled(x):
            return fused_ops.silu_and_mul(x)
        if cpu_kernels.silu_applies(x):
            return cpu_kernels.silu_and_mul(x)  # one pass, bitwise the lines below
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [T, inter] tensor less
