import torch
from torch import nn

from nanovllm.layers.triton_switch import LazyKernels

fused_ops = LazyKernels("nanovllm.layers.fused_ops", "NANOVLLM_FUSED_OPS")  # Triton only when used


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF does; optionally adds the residual first.

    forward(x) -> normed; forward(x, residual) -> (normed(x + residual), x + residual).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if x.dtype == dtype:  # float32: the weight multiplies in place (one [T, hidden] tensor less)
            return x.mul_(self.weight)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_ops.enabled(x):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
