"""CPU matmuls through oneDNN with prepacked weights.

On a CPU, decode steps multiply a few rows by every weight matrix: MKL's sgemm
on plain row-major weights reaches a fraction of memory bandwidth there, while
oneDNN's prepacked (blocked) weights run about 2x faster for 1-64 rows (measured
on the 2-core development machine: 31 rows through SmolLM2's 30 layers, 158 ->
81 ms). oneDNN's result for a row also does not depend on the other rows of the
batch, which keeps batch-invariance exact, once a row alone is multiplied as a pair where oneDNN
sums a single row in another order (``linear``: K > 1,024 on the development machine).

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
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.cpu_threads import physical_cores

logger = logging.getLogger(__name__)
PACK_BATCH_HINT = 32  # decode-sized batches are where packing pays


MLP_ROW_TILE = 1024


def mlp_row_tile(x: torch.Tensor) -> int | None:
    """Rows per piece for a CPU MLP over many tokens (a prefill chunk), None for one piece.

    A 4,096-token chunk's [gate | up] product is 4,096 x 2 x intermediate floats (50 MB for
    SmolLM2-135M): more than the last-level cache, so the product's output, SiLU and the down
    projection each stream it from memory. 1,024 rows at a time keep it in cache: the MLP of a
    4,096-token chunk took 108 instead of 120-130 ms on the 2-core development machine (oneDNN's
    rows do not depend on each other: the same result, bitwise)."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] <= 2 * MLP_ROW_TILE:
        return None
    return MLP_ROW_TILE


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes this CPU's oneDNN runs natively: float32, and bfloat16 where supported."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


# (N, K, dtype, bias, threads) -> whether one row alone is multiplied as a pair (``_single_row_differs``;
# oneDNN's order for one row can depend on the thread count)
_PAIR_SINGLE_ROWS: dict[tuple, bool] = {}


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _single_row_differs(packed: torch.Tensor, bias: torch.Tensor | None, k: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies one row with another summation order than the same row among others.

    It does for K > 1,024 on the development machine (torch 2.13.0+cpu, AVX-512): one row's products
    are summed in K blocks of 512, each block from zero, where two or more rows chain the blocks in
    pairs, so the last bits differ, and a batch-1 decode step would not give the bits the same row
    gets in a batch (for K <= 1,024, and between any two batch sizes >= 2 up to 4,096, the orders
    agree). Asked once per shape and thread count with a random float32 row alone and in a pair: where
    the orders differ they differ in nearly every float32 output. A 16-bit output rounds most such
    differences away, so one probe row would miss them (a review found 6-16 of 64 bfloat16 rows
    differing where the probe saw none): 16-bit rows are always paired."""
    if dtype != torch.float32:
        return True
    probe = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    return not torch.equal(_product(probe[:1], packed, bias)[0], _product(probe, packed, bias)[0])


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias; with oneDNN's packed weight a row's result does not depend on the rows
    beside it: a row alone goes in as a pair (itself twice) where oneDNN would sum it otherwise."""
    if packed is None or x.dim() != 2 or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    x = x.contiguous()
    if x.shape[0] == 1:
        key = (weight.shape[0], weight.shape[1], x.dtype, bias is not None, torch.get_num_threads())
        pair = _PAIR_SINGLE_ROWS.get(key)
        if pair is None:
            pair = _PAIR_SINGLE_ROWS[key] = _single_row_differs(packed, bias, weight.shape[1], x.dtype)
        if pair:
            return _product(x.expand(2, -1).contiguous(), packed, bias)[:1]
    return _product(x, packed, bias)


def pack_linear_weights(model: nn.Module, threads: int | None = None) -> int:
    """Give every module with a ``packed_weight`` slot a oneDNN-packed copy of its weight (float32,
    or bfloat16 where the CPU runs it natively: ``packable_dtypes``).

    oneDNN packs one matrix on one thread, so the matrices are packed ``threads`` at a time
    (default: the physical cores this process may use, even where torch was given fewer threads
    because other processes keep cores busy: packing threads never wait for each other, so a
    shared core still adds its share). Start-up packs SmolLM2-135M's 121 matrices in half the
    time on 2 cores."""
    if not available():
        logger.info("oneDNN is not available: CPU linear layers use F.linear")
        return 0
    dtypes = packable_dtypes()
    modules = [
        module
        for module in model.modules()
        if hasattr(module, "packed_weight") and module.weight.dtype in dtypes and module.weight.device.type == "cpu"
    ]

    def pack(module: nn.Module) -> torch.Tensor:
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)

    threads = max(1, threads or physical_cores())
    if threads == 1 or len(modules) < 2:
        packed = [pack(m) for m in modules]
    else:
        with ThreadPoolExecutor(threads) as pool:
            packed = list(pool.map(pack, modules))
    for module, weight in zip(modules, packed):
        module.packed_weight = weight
    return len(modules)
