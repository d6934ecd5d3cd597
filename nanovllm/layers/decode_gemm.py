"""Linear layers at the smallest decode batches on the GPU: y = x @ w.T for 1-4 rows (Triton),
launched with programmatic dependent launch.

At decode batch sizes a linear layer reads its whole weight matrix to do little arithmetic, and
cuBLAS takes ~5-8 us for the 4-13 MB matrices of a Qwen3-0.6B layer on the H200 (KERNEL_NOTES
sessions 8 and 12), against 1-3 us for their bytes. cuBLAS kernels cannot be launched with PDL
(``layers/pdl.py``), so each also waits in full for the Triton kernel before it, four times per
layer and step. This kernel gives each program a strip of output columns and all rows of x in one
tile, its K loop pipelined, and is launched with PDL like the Triton kernels around it.

Measured on an H200 (session 12): 28 layers of RMSNorm, the four products and SiLU-and-mul in one
CUDA graph ran 27.7-29.0 against cuBLAS's 32.3-34.4 us per layer at 1-16 rows; in the engine (Qwen3-
0.6B shape, 128 tokens per request) the time per output token went 1.255 -> 1.075 ms at batch 1 and
1.17-1.30 -> 1.11 ms at batch 4, but 1.133 -> 1.154 ms at batch 8 and 1.239 -> 1.249 at 16 (slower).
So rows above ``MAX_ROWS`` (4) take cuBLAS. It is on by default where PDL is (Hopper and later, the
only GPUs it was measured on); ``NANOVLLM_DECODE_GEMM=1`` forces it on elsewhere, ``=0`` keeps cuBLAS
for every batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.layers import pdl
from nanovllm.layers.triton_switch import triton_path

SWITCH = "NANOVLLM_DECODE_GEMM"
MAX_ROWS = 4  # rows above this take cuBLAS (measured slower in the engine from batch 8)
PRELOAD_MAX_ROWS = 0  # rows up to which the preloading kernel takes the product (0: off; session 16 A/B)
MAX_K_CHUNKS = 4  # the preloading kernel holds K as up to four power-of-two chunks (w0..w3 in the kernel)
SHARED_MEMORY = 232_448  # bytes a program may use on sm_90 (H100/H200); the preloading kernel's must fit
MAX_BLOCK_M = 64  # rows per program (a larger MAX_ROWS in A/B runs: more row blocks, the strip read again)
WIDE_N = 128 * 32  # outputs this wide get 32-column strips: still >= 128 programs for the 132 SMs


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # output columns per program (a power of two >= 16: tl.dot's smallest tile)
    block_k: int  # weight columns per step of the K loop
    num_warps: int
    num_stages: int


def default_config(n: int, k: int) -> GemmConfig:
    """32-column strips where that still gives >= 128 programs (the 132 SMs), 16 otherwise."""
    return GemmConfig(32 if n >= WIDE_N else 16, 256 if k % 256 == 0 else 128, 4, 3)


def parse_config(spec: str) -> Callable[[int, int], GemmConfig]:
    """``BIG/SMALLxBKxWxS`` (A/B runs: scripts/ab_kernels.py, ab_engine.py): column strips for outputs
    of at least ``WIDE_N`` / narrower ones, K step, warps, stages -> a ``default_config`` stand-in.
    Raises ValueError naming the spec when it is malformed or a strip is not a power of two >= 16."""
    try:
        strips, bk, warps, stages = spec.split("x")
        big, small = (int(v) for v in strips.split("/"))
        numbers = (big, small, int(bk), int(warps), int(stages))
    except ValueError:
        raise ValueError(f"decode GEMM config {spec!r} is not BIG/SMALLxBKxWxS (e.g. 32/16x256x4x3)") from None
    if min(numbers) <= 0 or any(v < 16 or v & (v - 1) for v in (big, small, numbers[2])):
        raise ValueError(f"decode GEMM config {spec!r}: strips and the K step must be powers of two >= 16")
    return lambda n, k: GemmConfig(big if n >= WIDE_N else small, *numbers[2:])


def enabled(x: torch.Tensor) -> bool:
    """On where Triton runs for ``x`` (a CUDA tensor; the interpreter in the CPU kernel tests):
    ``NANOVLLM_DECODE_GEMM=1`` or ``0`` decides; unset, it is on where the launches overlap (PDL:
    Hopper and later), the only GPUs it was measured on and the reason it exists."""
    if not triton_path(x, SWITCH):
        return False
    switch = os.environ.get(SWITCH)
    return pdl.enabled(x) if switch is None else switch == "1"


def _decode_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> bool:
    """What both decode-batch kernels need: 2-D rows, 1 to ``max_rows`` of them, 16-bit, no bias, unit
    column strides, matching K."""
    return (
        bias is None
        and x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] == x.shape[1]
    )


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """This kernel takes the product: a decode product (``_decode_product``) of 1 to MAX_ROWS rows, K a
    multiple of the config's K step (whole steps, no mask on K)."""
    return (
        _decode_product(x, weight, bias, MAX_ROWS)
        and x.shape[1] % default_config(weight.shape[0], x.shape[1]).block_k == 0
    )


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (column strip, row block): y[rows, strip] = x[rows, :] @ w[strip, :].T, float32
    accumulation over K in order (a row's result does not depend on the other rows), rounded once."""
    pdl.wait_then_release(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn  # rows past N: N - 1's
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_rows + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_m(rows: int) -> int:
    return max(16, min(MAX_BLOCK_M, triton.next_power_of_2(rows)))


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (``applies`` must hold)."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(n, k)
    if k % cfg.block_k:
        raise ValueError(f"decode_gemm: K={k} is not a multiple of block_k={cfg.block_k}")
    bm = block_m(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm))
    launch = pdl.launch_args(x)
    _decode_gemm_kernel[grid](
        x,
        weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch,
    )
    return y


@dataclass(frozen=True)
class PreloadConfig:
    block_n: int  # output columns per program (a power of two >= 16)
    block_m: int  # rows per step of the row loop (a power of two >= 16)
    num_warps: int


def preload_config(n: int, k: int) -> PreloadConfig:
    """32-column strips for outputs of at least ``WIDE_N`` (>= 128 programs), 16 below; 16 rows per step
    and 8 warps. The strip is held in registers across the wait (a 32 x 1,024 bf16 strip: 64 KB, 64
    registers a thread at 8 warps), then copied to shared memory for the products (``shared_bytes``)."""
    return PreloadConfig(32 if n >= WIDE_N else 16, 16, 8)


def shared_bytes(cfg: PreloadConfig, k: int, chunk: int) -> int:
    """The preloading kernel's shared memory in bytes: the strip (``block_n x K``) and a step of x
    (``block_m x`` one chunk), 16-bit values, as Triton 3.6 allocates them for sm_90 (offline compiles:
    98,304 bytes at 32 x 1,024 with 16-row steps, 131,072 at 16 x 3,072, 294,912 at 32 x 4,096)."""
    return 2 * (cfg.block_n * k + cfg.block_m * chunk)


def parse_preload_config(spec: str) -> Callable[[int, int], PreloadConfig]:
    """``BIG/SMALLxBMxW`` (A/B runs): strips for outputs of at least ``WIDE_N`` / narrower ones, rows per
    step, warps -> a ``preload_config`` stand-in. Raises ValueError naming a malformed spec."""
    try:
        strips, bm, warps = spec.split("x")
        big, small = (int(v) for v in strips.split("/"))
        numbers = (big, small, int(bm), int(warps))
    except ValueError:
        raise ValueError(f"preload GEMM config {spec!r} is not BIG/SMALLxBMxW (e.g. 32/16x16x8)") from None
    if min(numbers) <= 0 or any(v < 16 or v & (v - 1) for v in numbers[:3]):
        raise ValueError(f"preload GEMM config {spec!r}: strips and rows per step must be powers of two >= 16")
    return lambda n, k: PreloadConfig(big if n >= WIDE_N else small, numbers[2], numbers[3])


def k_chunks(k: int) -> tuple[int, int] | None:
    """K as ``count`` chunks of ``size`` (the largest power of two dividing K, at most 1,024), or None
    where that takes more than ``MAX_K_CHUNKS`` chunks or a chunk is under 16 (tl.dot's smallest K)."""
    size = min(1024, k & -k)
    return (size, k // size) if size >= 16 and k // size <= MAX_K_CHUNKS else None


def preload_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The preloading kernel takes the product: a decode product (``_decode_product``) of 1 to
    PRELOAD_MAX_ROWS rows, K in at most ``MAX_K_CHUNKS`` power-of-two chunks, and its shared memory within
    ``SHARED_MEMORY`` (a 32-column strip of K = 4,096 is not: an 8B model's qkv takes cuBLAS)."""
    if not _decode_product(x, weight, bias, PRELOAD_MAX_ROWS):
        return False
    k = x.shape[1]
    chunks = k_chunks(k)
    return chunks is not None and shared_bytes(preload_config(weight.shape[0], k), k, chunks[0]) <= SHARED_MEMORY


@triton.jit(do_not_specialize=["M"])
def _preload_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (column strip): its whole weight strip w[strip, :] is loaded *before* the wait for the
    kernel before it (the weights are no kernel's output), so with PDL those bytes stream while that
    kernel still runs; then y[rows, strip] = x @ strip.T, BLOCK_M rows at a time, float32 accumulation
    over K in chunk order (a row's result does not depend on the other rows), rounded once."""
    tl.static_assert(NK <= 4, "the kernel holds at most four K chunks (w0..w3)")
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn  # rows past N: N - 1's
    offs_k = tl.arange(0, BK)
    w0 = tl.load(w_rows + offs_k[None, :])
    w1 = w0  # chunks past NK are never used (static branches below)
    w2 = w0
    w3 = w0
    if NK > 1:
        w1 = tl.load(w_rows + BK + offs_k[None, :])
    if NK > 2:
        w2 = tl.load(w_rows + 2 * BK + offs_k[None, :])
    if NK > 3:
        w3 = tl.load(w_rows + 3 * BK + offs_k[None, :])
    pdl.wait_then_release(PDL)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        acc = tl.dot(tl.load(x_ptrs, mask=m_mask[:, None], other=0.0), tl.trans(w0))
        if NK > 1:
            acc = tl.dot(tl.load(x_ptrs + BK, mask=m_mask[:, None], other=0.0), tl.trans(w1), acc)
        if NK > 2:
            acc = tl.dot(tl.load(x_ptrs + 2 * BK, mask=m_mask[:, None], other=0.0), tl.trans(w2), acc)
        if NK > 3:
            acc = tl.dot(tl.load(x_ptrs + 3 * BK, mask=m_mask[:, None], other=0.0), tl.trans(w3), acc)
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def preload_linear(x: torch.Tensor, weight: torch.Tensor, config: PreloadConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (``preload_applies`` must hold)."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = k_chunks(k)
    if chunks is None:
        raise ValueError(f"preload_gemm: K={k} is not {MAX_K_CHUNKS} or fewer power-of-two chunks of 16-1,024")
    cfg = config or preload_config(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _preload_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        y,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BK=chunks[0],
        NK=chunks[1],
        num_warps=cfg.num_warps,
        num_stages=1,
        **pdl.launch_args(x),
    )
    return y
