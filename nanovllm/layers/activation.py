import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import fused_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, for the merged [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.enabled(x):
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
