"""Linear layers at decode batch sizes with K split across programs (split-K), reduced inside the
kernel: y = x @ w.T for a few to a few hundred rows (Triton), launched with programmatic dependent
launch.

At decode batches a linear layer reads its whole weight matrix for little arithmetic, and what bounds
it is not the bytes but each program's serial K loop: cuBLAS and session 8's strip kernel both took
~5-8 us for any of Qwen3-0.6B's 4-13 MB matrices on an H200, against 1-3 us for their bytes, and
~25 us per layer for the four products at batch 129 (KERNEL_NOTES sessions 8, 10 and 15). Here each
program takes one output tile (``block_n`` output features x up to ``max_block_m`` rows) and one
``K / split`` share of K, so a layer's ~16-96 output tiles become >= one wave of programs with
short K loops. Each program writes its float32 partial, then takes a ticket from its tile's counter
(``atomic_add``, acquire-release); the program that draws the last ticket sums the tile's partials
in split order (its own from registers: the same bits), rounds once, writes y and resets the
counter to 0 for the next call (CUDA graph replays included). So the sum's order is fixed, whichever
program finishes last: the result is deterministic run to run.

The MMA runs transposed, ``acc[n, m] = w[n, :] @ x[m, :].T``: the output features fill the MMA's
M side (>= 64 rows, Hopper's ``wgmma``) and the few rows of x its N side (>= 16).

Off by default until measured (``NANOVLLM_SPLITK_GEMM=LO:HI`` takes rows LO..HI, ``0`` or unset
none); ``scripts/ab_kernels.py --only gemm --gemms cublas,sk64x128x4x3x128`` times it in the layer
chain and ``ab_engine.py splitk=LO:HI`` in the engine.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.layers import pdl
from nanovllm.layers.triton_switch import triton_path

SWITCH = "NANOVLLM_SPLITK_GEMM"


def parse_rows(text: str) -> tuple[int, int]:
    """``LO:HI`` (the rows it takes) or ``0`` (none) -> (lo, hi); ValueError naming the variable."""
    if text.strip() == "0":
        return (0, 0)
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        lo = hi = -1
    if not 0 < lo <= hi:
        raise ValueError(f"{SWITCH} must be LO:HI with 0 < LO <= HI, or 0 (off), got {text!r}")
    return (lo, hi)


ROWS: tuple[int, int] = parse_rows(os.environ.get(SWITCH, "0"))  # (0, 0): off
MAX_COUNTERS = 1 << 14  # output tiles one call may have (the counters are one int32 each, kept per device)


@dataclass(frozen=True)
class SplitKConfig:
    block_n: int  # output features per program: the MMA's M side (a power of two >= 16)
    block_k: int  # K per step of a program's loop (a power of two >= 16)
    num_warps: int
    num_stages: int
    max_block_m: int  # rows of x per program at most (a power of two >= 16)
    waves: int = 1  # the split makes at least this many programs per SM


def default_config(n: int, k: int) -> SplitKConfig:
    return SplitKConfig(64, 128 if k % 128 == 0 else 64, 4, 3, 128)


def parse_config(spec: str) -> Callable[[int, int], SplitKConfig]:
    """``skBNxBKxWxSxBM[wV]`` (A/B runs: scripts/ab_kernels.py, ab_engine.py): output features per
    program, K step, warps, stages, the most rows per program, and optionally programs per SM ->
    a ``default_config`` stand-in. ValueError naming the spec when it is malformed."""
    body = spec.removeprefix("sk")
    waves = 1
    if "w" in body:
        body, _, w = body.partition("w")
        waves = int(w) if w.isdigit() else -1
    try:
        bn, bk, warps, stages, bm = (int(v) for v in body.split("x"))
    except ValueError:
        raise ValueError(f"split-K GEMM config {spec!r} is not skBNxBKxWxSxBM[wV] (e.g. sk64x128x4x3x128)") from None
    if waves < 1 or min(warps, stages) < 1 or any(v < 16 or v & (v - 1) for v in (bn, bk, bm)):
        raise ValueError(f"split-K GEMM config {spec!r}: BN, BK and BM must be powers of two >= 16, the rest >= 1")
    cfg = SplitKConfig(bn, bk, warps, stages, bm, waves)
    return lambda n, k: cfg


def block_m(rows: int, cfg: SplitKConfig) -> int:
    return max(16, min(cfg.max_block_m, triton.next_power_of_2(rows)))


def split_count(tiles: int, k: int, block_k: int, programs: int) -> int:
    """The fewest splits of K (each a whole number of ``block_k`` steps) that give at least
    ``programs`` programs over ``tiles`` output tiles; the most there are when none does."""
    steps = k // block_k
    for split in range(1, steps + 1):
        if steps % split == 0 and tiles * split >= programs:
            return split
    return steps


def enabled(x: torch.Tensor) -> bool:
    """On where Triton runs for ``x`` (``NANOVLLM_DECODE_GEMM=0`` keeps cuBLAS for every batch) and a
    row range is set (``NANOVLLM_SPLITK_GEMM``)."""
    return ROWS[0] > 0 and triton_path(x, "NANOVLLM_DECODE_GEMM")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """This kernel takes the product: 2-D rows within ``ROWS``, 16-bit, no bias, unit column strides,
    K a multiple of the config's K step."""
    lo, hi = ROWS
    return (
        bias is None
        and x.dim() == 2
        and weight.dim() == 2
        and lo <= x.shape[0] <= hi
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] == x.shape[1]
        and x.shape[1] % default_config(weight.shape[0], x.shape[1]).block_k == 0
    )


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """The tiles' ticket counters on ``device``: zero, and every call leaves them zero. Made on the
    first eager call (the engine's warm-up runs before any CUDA graph is captured): one made during a
    capture would live in the graph's private pool."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("splitk_gemm: the first call on a device must run eagerly, not under CUDA graph capture")
    return torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few programs per tile are enough to exercise the split
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(do_not_specialize=["M"])
def _splitk_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (feature tile, row tile, split): acc[n, m] = w[tile, split's K] @ x[rows, split's K].T
    in float32; the last of a tile's SPLIT_K programs to finish sums them in split order into y."""
    pdl.wait_then_release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # past N: N - 1
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x's rows as columns
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs, mask=m_mask[None, :], other=0.0), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part = part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        offs_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(part + pid_k * (BLOCK_N * BLOCK_M) + offs_tile, acc, mask=out_mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last: every other partial is written and visible
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                other = tl.load(
                    part + s * (BLOCK_N * BLOCK_M) + offs_tile,
                    mask=out_mask & (s != pid_k),
                    other=0.0,
                    cache_modifier=".cg",
                )
                total += tl.where(s == pid_k, acc, other)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call


def linear(x: torch.Tensor, weight: torch.Tensor, config: SplitKConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (``applies`` must hold, or a config given)."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(n, k)
    if k % cfg.block_k:
        raise ValueError(f"splitk_gemm: K={k} is not a multiple of block_k={cfg.block_k}")
    bm = block_m(m, cfg)
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm)
    tiles = grid_n * grid_m
    if tiles > MAX_COUNTERS:
        raise ValueError(f"splitk_gemm: {tiles} output tiles exceed the {MAX_COUNTERS} counters")
    split = split_count(tiles, k, cfg.block_k, cfg.waves * _sms(x.device))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty(tiles * split * cfg.block_n * bm if split > 1 else 1, dtype=torch.float32, device=x.device)
    _splitk_gemm_kernel[(grid_n, grid_m, split)](
        x,
        weight,
        y,
        part,
        _counters(x.device),
        m,
        n,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        K_SPLIT=k // split,
        SPLIT_K=split,
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_args(x),
    )
    return y
