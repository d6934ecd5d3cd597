"""CPU matmuls through oneDNN with prepacked weights.

On a CPU, decode steps multiply a few rows by every weight matrix: MKL's sgemm
on plain row-major weights reaches a fraction of memory bandwidth there, while
oneDNN's prepacked (blocked) weights run about 2x faster for 1-64 rows (measured
on the 2-core development machine: 31 rows through SmolLM2's 30 layers, 158 ->
81 ms). oneDNN's result for a row also does not depend on the other rows of the
batch, which keeps batch-invariance exact.

The packed copy is made once, after the weights are loaded
(``pack_linear_weights``); the plain weight stays the source of truth for
loading and sharding. A layer without a packed weight uses ``F.linear``.

bfloat16 weights are packed too where the CPU multiplies bfloat16 natively (oneDNN reports it:
AVX-512 BF16 or AMX): there a bfloat16 matmul runs at about twice the float32 rate (2-core
development machine, 4096x576 @ 576x1728: 186 -> 383 GFLOP/s). Elsewhere oneDNN would emulate
bfloat16, so those weights keep ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
PACK_BATCH_HINT = 32  # decode-sized batches are where packing pays


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes this CPU's oneDNN runs natively: float32, and bfloat16 where supported."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None or x.dim() != 2 or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a ``packed_weight`` slot a oneDNN-packed copy of its weight (float32,
    or bfloat16 where the CPU runs it natively: ``packable_dtypes``)."""
    if not available():
        logger.info("oneDNN is not available: CPU linear layers use F.linear")
        return 0
    count = 0
    dtypes = packable_dtypes()
    for module in model.modules():
        if hasattr(module, "packed_weight") and module.weight.dtype in dtypes and module.weight.device.type == "cpu":
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_HINT)
            count += 1
    return count
