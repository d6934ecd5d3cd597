"""CPU matmuls with prepacked weights: our rows kernel for float32 (batch-invariant), oneDNN otherwise.

On a CPU, decode steps multiply a few rows by every weight matrix: MKL's sgemm
on plain row-major weights reaches a fraction of memory bandwidth there, while
oneDNN's prepacked (blocked) weights run about 2x faster for 1-64 rows (measured
on the 2-core development machine: 31 rows through SmolLM2's 30 layers, 158 ->
81 ms). On the development machine oneDNN's result for a row also does not depend on the other
rows of the batch, once a row alone is multiplied as a pair where oneDNN sums a single row in another
order (``linear``: K > 1,024 there). That is this machine's oneDNN, not a promise: on another (a GPU
host's CPU, torch 2.11) a row's bfloat16 and float32 bits changed with the batch size.

The packed copy is made once, after the weights are loaded
(``pack_linear_weights``); the plain weight stays the source of truth for
loading and sharding. A layer without a packed weight uses ``F.linear``.

bfloat16 weights are packed too where the CPU multiplies bfloat16 natively (oneDNN reports it:
AVX-512 BF16 or AMX): there a bfloat16 matmul runs at about twice the float32 rate (2-core
development machine, 4096x576 @ 576x1728: 186 -> 383 GFLOP/s). Elsewhere oneDNN would emulate
bfloat16, so those weights keep ``F.linear``.

float32 weights go to our own kernel where it is built (``rows_linear.c``: AVX-512, or AVX2 with FMA): each output one
fused multiply-add chain over K, restarted every ``segment(K)`` elements, the pieces added in order,
then the bias, whatever the batch or thread count, so a row's bits never depend on the rows beside it
(no lone-row pairing needed), on any machine. It streams a decode step's weights faster than oneDNN
(1.4-1.9x at 1-4 rows, 1.1-1.3x at 8-64, level for prefill chunks; AMD development machine, SmolLM2-135M;
with AVX2, 1.4-1.7x at 1-16 rows and 1.1-1.2x at 32-1,024 on an AVX2 EPYC),
and its packed copy (``RowsWeight``) replaces oneDNN's, so memory stays one packed copy per weight.
The segments are oneDNN's own on both development machines (AMD EPYC and Intel Xeon, AVX-512, torch
2.13.0+cpu), so there both products give the same bits; another machine's oneDNN may sum otherwise (one seen did, for
every shape), and there the kernel's bits are its own. At packing, the vector code is checked once per
shape against a scalar reference of its order (``_kernel_keeps_its_order``); a shape that fails keeps
oneDNN's packed copy, and a log line says so.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import cpu_kernels
from nanovllm.cpu_threads import physical_cores

logger = logging.getLogger(__name__)
PACK_BATCH_HINT = 32  # decode-sized batches are where packing pays


MLP_ROW_TILE = 1024
ROWS_SWITCH = "NANOVLLM_CPU_ROWS_LINEAR"  # "0": float32 weights keep oneDNN's packed copy (A/B runs)


QUANT_SWITCH = "NANOVLLM_CPU_ROWS_QUANT"  # "0": float32 strips even where a block format gives a weight back (A/B runs)


class RowsWeight:
    """A float32 weight packed for ``cpu_kernels.rows_linear`` (strips of 16 output columns) and the
    K segment its sums restart at, oneDNN's on this machine (``segment``).

    ``form``: "f32", a GGUF block format (``cpu_kernels.ROWS_FORMATS``), or None for the smallest
    form that gives the weight back bitwise: a weight read from a Q4_1 or Q8_0 GGUF file is kept in
    that format, a third to a fifth of float32's bytes, which a decode step streams from memory; the
    product's bits are the float32 strips' (rows_quant.c). ``NANOVLLM_CPU_ROWS_QUANT=0`` keeps float32."""

    dtype = torch.float32

    def __init__(self, weight: torch.Tensor, form: str | None = None) -> None:
        self.n, self.k = weight.shape
        self.segment = segment(self.k)
        strips = _smallest_exact_form(weight) if form is None else _packed(weight, form)
        if strips is None:
            raise ValueError(f"RowsWeight: the weight [{self.n}, {self.k}] has no exact {form} form")
        self.strips = strips
        self.format = cpu_kernels.rows_format(strips)


def quant_enabled() -> bool:
    return os.environ.get(QUANT_SWITCH, "1") != "0"


def _packed(weight: torch.Tensor, form: str) -> torch.Tensor | None:
    return cpu_kernels.rows_pack(weight) if form == "f32" else cpu_kernels.rows_pack_quant(weight, form)


def _smallest_exact_form(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the first block format (the smallest first) that gives it back bitwise, else as
    float32 strips. Trying a format stops at the first block without an exact form, so a float32
    checkpoint's weights cost little."""
    if quant_enabled():
        for form in cpu_kernels.ROWS_FORMATS:
            strips = cpu_kernels.rows_pack_quant(weight, form)
            if strips is not None:
                return strips
    return cpu_kernels.rows_pack(weight)


def segment(k: int) -> int:
    """Where the rows kernel restarts a sum along K: nowhere up to K = 512, every 512 up to 1,024,
    every 1,024 beyond. That is oneDNN's float32 order (two or more rows) on the AVX-512 development
    machine, measured for K 64-8,192 (tests/test_cpu_rows_linear.py compares the two where a machine's
    oneDNN follows it), so there the kernel and oneDNN give the same bits."""
    return k if k <= 512 else 512 if k <= 1024 else 1024


def rows_enabled() -> bool:
    return os.environ.get(ROWS_SWITCH, "1") != "0" and cpu_kernels.rows_linear_available()


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


def _check_rows() -> tuple[int, ...]:
    """Probe rows for ``_kernel_keeps_its_order``: a lone row and 2 (one row tile, whole segments); 3, 4
    and 5 (the AVX2 code's tiles of 3-5 rows: decode steps of that size run nothing else); 7, 13 and the
    most the chunked path takes (K in chunks; a partial last row tile; all of its scratch); one more
    (whole segments per row tile)."""
    most = cpu_kernels.rows_chunk_max_rows()
    return (1, 2, 3, 4, 5, 7, 13, most, most + 1)


CHECK_COLUMNS = 256  # output columns probed at most, plus a last tile's remainder (the reference is scalar C)


def _probe_columns(n: int) -> int:
    """How many of a weight's first output columns the packing check multiplies: all of a small weight;
    else 256 and the weight's remainder modulo a tile's 64 columns (the same partial last tile)."""
    return n if n <= CHECK_COLUMNS + 64 else CHECK_COLUMNS + n % 64


def _kernel_keeps_its_order(weight: torch.Tensor, bias: torch.Tensor | None, form: str = "f32") -> bool:
    """Whether the vector kernel gives, bitwise, the scalar reference of its summation order
    (``cpu_kernels.rows_linear_reference``: one chain per ``segment``, the segments added in order, the
    bias last) for this weight's shape, on random rows (``_check_rows``: each of the kernel's paths) and
    the first output columns (``_probe_columns``). Then a row's bits depend
    only on the row and the weight, on any machine, whatever its batch or thread count. Random rows,
    because the summation order does not depend on values. Asked with the module's bias; a row-parallel
    layer under tensor parallelism adds its bias after the reduction instead, where the chain is the
    same. It guards against a compiler or CPU that makes the vector code leave its order (then the
    weight keeps oneDNN's packed product). ``form``: the weight's packed form; a block format's
    product is held to the same reference, over the float32 weight."""
    n, k = weight.shape
    cols = _probe_columns(n)
    weight = weight.detach()[:cols].contiguous()
    bias = None if bias is None else bias.detach()[:cols].contiguous()
    rows = RowsWeight(weight, form)
    check_rows = _check_rows()
    probe = torch.randn(max(check_rows), k, generator=torch.Generator().manual_seed(0))
    want = cpu_kernels.rows_linear_reference(probe, weight, bias, rows.segment)
    return all(
        torch.equal(cpu_kernels.rows_linear(probe[:m], rows.strips, rows.n, bias, rows.segment), want[:m])
        for m in check_rows
    )


def onednn_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, pair: bool) -> torch.Tensor:
    """oneDNN's packed product; with ``pair`` a lone row goes in as a pair (itself twice) and the first
    result comes back, where oneDNN would sum one row in another order than rows among others."""
    if pair:
        return _product(x.expand(2, -1).contiguous(), packed, bias)[:1]
    return _product(x.contiguous(), packed, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | RowsWeight | None,
) -> torch.Tensor:
    """x @ weight.T + bias; with a packed weight a row's result does not depend on the rows beside it.
    ``RowsWeight``: the rows kernel. oneDNN's packed weight: a row alone goes in as a pair (itself
    twice) where oneDNN would sum it otherwise."""
    if packed is None or x.dim() != 2 or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    if isinstance(packed, RowsWeight):
        return cpu_kernels.rows_linear(x, packed.strips, packed.n, bias, packed.segment)
    pair = False
    if x.shape[0] == 1:
        key = (weight.shape[0], weight.shape[1], x.dtype, bias is not None, torch.get_num_threads())
        if key not in _PAIR_SINGLE_ROWS:
            _PAIR_SINGLE_ROWS[key] = _single_row_differs(packed, bias, weight.shape[1], x.dtype)
        pair = _PAIR_SINGLE_ROWS[key]
    return onednn_product(x, packed, bias, pair)


def pack_linear_weights(model: nn.Module, threads: int | None = None) -> int:
    """Give every module with a ``packed_weight`` slot a packed copy of its weight: float32 weights
    a ``RowsWeight`` where the rows kernel is built and keeps its order for their shape
    (``_kernel_keeps_its_order``, once per shape), else oneDNN's packed copy (float32, or bfloat16 where
    the CPU runs it natively: ``packable_dtypes``).

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
    rows_modules = _pack_rows([m for m in modules if m.weight.dtype == torch.float32]) if rows_enabled() else []
    taken = set(map(id, rows_modules))
    modules = [m for m in modules if id(m) not in taken]

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
    return len(modules) + len(rows_modules)


def _pack_rows(modules: list[nn.Module]) -> list[nn.Module]:
    """Pack for the rows kernel each float32 module (in its smallest exact form: ``RowsWeight``) whose
    shape and form pass ``_kernel_keeps_its_order`` (asked with the first module of each shape, bias and
    form; a block format that fails leaves float32 strips to be asked); returns the modules packed so."""
    verdict: dict[tuple, bool] = {}
    done = []
    for module in modules:
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        bias = getattr(module, "bias", None)
        rows: RowsWeight | None = RowsWeight(weight.detach())
        while rows is not None:
            key = (*weight.shape, bias is not None, rows.format)
            if key not in verdict:
                verdict[key] = _kernel_keeps_its_order(weight, bias, rows.format)
                if not verdict[key]:
                    logger.warning(
                        "the rows kernel's vector code left its summation order for weights of N=%d, K=%d, "
                        "bias=%s, kept as %s (compared with its scalar reference): %s",
                        *key,
                        "float32 strips next" if rows.format != "f32" else "oneDNN multiplies them",
                    )
            if verdict[key]:
                module.packed_weight = rows  # type: ignore[assignment]
                done.append(module)
                break
            # a block format's kernel that fails its check leaves the float32 strips to be asked
            rows = RowsWeight(weight.detach(), "f32") if rows.format != "f32" else None
    return done
