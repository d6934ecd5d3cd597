"""What this GPU's memory streams in practice: the bandwidth ``nanovllm/bench/roofline.py`` keeps
per GPU, measured (KERNEL_NOTES sessions 10 and 20). A Triton kernel reads a buffer once (each program sums a
contiguous run of 16-byte vectors and writes one float, so the writes are negligible); torch's
``copy_`` (read + write) for comparison. do_bench's median, several sizes past the 50 MB L2.

    PYTHONPATH=. python3 scripts/hbm_bandwidth.py [--gib 0.5 2 8] [--matmul]

``--matmul`` also times bf16 matmuls on random data: with the copy rate, the two rates
``nanovllm/bench/roofline.py`` keeps per GPU (``DeviceLimits``).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, PER_PROGRAM, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_tbps(x: torch.Tensor, per_program: int, block: int, warps: int) -> float:
    n = x.numel()
    grid = triton.cdiv(n, per_program)
    out = torch.empty(grid, device=x.device, dtype=torch.float32)
    ms = do_bench(lambda: _read_kernel[(grid,)](x, out, n, PER_PROGRAM=per_program, BLOCK=block, num_warps=warps))
    return x.numel() * x.element_size() / ms / 1e9


def copy_tbps(x: torch.Tensor) -> float:
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / do_bench(lambda: y.copy_(x)) / 1e9


def matmul_tflops(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / do_bench(lambda: a @ b, warmup=100, rep=500) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, nargs="+", default=[0.5, 2, 8])
    p.add_argument("--matmul", action="store_true", help="also bf16 matmuls of 4096-16384 square")
    args = p.parse_args()
    if args.matmul:
        for n in (4096, 8192, 16384):
            print(f"bf16 matmul {n} x {n} x {n}: {matmul_tflops(n):.0f} TFLOP/s", flush=True)
    print(f"# {torch.cuda.get_device_name()}; read: one pass, TB/s (10^12 B/s); copy: read + write bytes")
    for gib in args.gib:
        x = torch.ones(int(gib * 2**30) // 2, device="cuda", dtype=torch.bfloat16)
        best = {}
        for per_program in (2**16, 2**18, 2**20):
            for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
                best[(per_program, block, warps)] = read_tbps(x, per_program, block, warps)
        cfg, tbps = max(best.items(), key=lambda kv: kv[1])
        copy = copy_tbps(x)
        print(
            f"{gib:5.1f} GiB  read {tbps:.2f} TB/s (elements per program, block, warps = {cfg}; "
            f"worst config {min(best.values()):.2f})  copy {copy:.2f} TB/s"
        )
        del x


if __name__ == "__main__":
    main()
