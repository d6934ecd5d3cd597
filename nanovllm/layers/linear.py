"""Tensor-parallel linear layers. Each parameter carries its own ``weight_loader``.

Column-parallel layers split the output features across ranks (no communication);
row-parallel layers split the input features and all-reduce the partial sums.
Merged layers (QKV, gate/up) hold several checkpoint tensors in one matrix; the
loader passes a shard id saying which part a checkpoint tensor fills.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers import cpu_linear
from nanovllm.layers.parallel import all_reduce, divide, tp_rank, tp_size
from nanovllm.layers.triton_switch import LazyKernels
from nanovllm.loader.model_loader import set_weight

decode_gemm = LazyKernels("nanovllm.layers.decode_gemm", "NANOVLLM_DECODE_GEMM")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | cpu_linear.RowsWeight | None,
) -> torch.Tensor:
    """y = x @ weight.T + bias: the Triton decode-batch kernel where it is on and applies (CUDA, few
    rows; on the CPU only in the kernel tests under Triton's interpreter), the packed weights on the
    CPU (our rows kernel for float32, oneDNN's otherwise: ``cpu_linear``), ``F.linear`` elsewhere."""
    if decode_gemm.enabled(x):
        if decode_gemm.preload_applies(x, weight, bias):
            return decode_gemm.preload_linear(x, weight)
        if decode_gemm.applies(x, weight, bias):
            return decode_gemm.linear(x, weight)
    return cpu_linear.linear(x, weight, bias, packed)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """``loaded`` into ``param`` (a whole Parameter: it may take the checkpoint tensor itself,
    see ``set_weight``; a slice of a merged one: copied)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"weight {what}: checkpoint shape {tuple(loaded.shape)} does not match the model's {tuple(param.shape)}"
        )
    set_weight(param, loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.packed_weight: torch.Tensor | cpu_linear.RowsWeight | None = None  # packed copy on CPU (cpu_linear.py)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along tp_dim."""
        if self.tp_dim is None or tp_size() == 1 or (param.dim() == 1 and self.tp_dim == 1):
            return loaded
        size = param.shape[self.tp_dim]
        if loaded.shape[self.tp_dim] != size * tp_size():
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)} cannot be split into "
                f"{tp_size()} shards of {size} along dim {self.tp_dim}"
            )
        return loaded.narrow(self.tp_dim, tp_rank() * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        _copy_checked(param, self._shard(param, loaded), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size(), "output size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id: int = 0) -> None:
        tp = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(loaded.shape)}, expected {self.output_sizes[shard_id]} rows"
            )
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, tp_rank() * size, size), name)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. With fewer KV heads than ranks, each KV
    head is replicated on ``tp_size // num_kv_heads`` ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
        else:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"num_key_value_heads={total_num_kv_heads} cannot be replicated "
                    f"evenly over tensor_parallel_size={tp}"
                )
            self.num_kv_heads = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id: str = "q") -> None:
        hd = self.head_dim
        if shard_id == "q":
            offset, size, total = 0, self.num_heads * hd, self.total_num_heads * hd
            start = tp_rank() * size
        else:
            offset = self.num_heads * hd + (0 if shard_id == "k" else self.num_kv_heads * hd)
            size, total = self.num_kv_heads * hd, self.total_num_kv_heads * hd
            replicas = max(1, tp_size() // self.total_num_kv_heads)
            start = (tp_rank() // replicas) * size
        if loaded.shape[0] != total:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(loaded.shape)}, expected {total} rows for {shard_id}"
            )
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size), name)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size(), "input size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        # the bias is added once, after the reduction
        y = linear(x, self.weight, None, self.packed_weight)
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
