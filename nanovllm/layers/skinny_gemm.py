"""Linear layers at decode batch sizes on the GPU: y = x @ w.T for a few rows (Triton).

At 1-64 rows a linear layer reads its whole weight matrix to do little arithmetic, so its
time is the weight bytes over the achieved bandwidth. cuBLAS's kernels for these shapes
reach ~2.3 TB/s on the H200 (5.3-5.7 us for the 4-13 MB matrices of a Qwen3-0.6B layer,
KERNEL_NOTES); the kernel here gives each program a strip of output columns and streams
its weight rows through a deep pipeline, all rows of x in one tile.

``NANOVLLM_SKINNY_GEMM=0`` keeps cuBLAS (A/B runs); rows above ``MAX_ROWS`` always take it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.layers.triton_switch import triton_path

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 64  # rows above this take cuBLAS


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output columns per program
    block_k: int  # weight columns per pipeline stage
    num_warps: int
    num_stages: int


def default_config(n: int, k: int) -> SkinnyConfig:
    # enough programs to cover the 132 SMs: 16-column strips for the 1,024-wide outputs
    return SkinnyConfig(32 if n >= 4096 else 16, 256, 4, 4)


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and triton_path(x, "NANOVLLM_SKINNY_GEMM")


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """This kernel takes the product: 2-D rows, at most MAX_ROWS of them, 16-bit, unit column strides."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(
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
        EVEN_K: tl.constexpr,
    ):
        """Program (column strip, row block): y[rows, strip] = x[rows, :] @ w[strip, :].T, float32
        accumulation, rounded once."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (M <= MAX_ROWS)."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"skinny linear: x has {k} columns, weight has {k_w}")
    cfg = config or default_config(n, k)
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(m)))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    _skinny_kernel[grid](
        x,
        weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
