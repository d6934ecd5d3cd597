"""A check the rows kernel's tests share: a product built apart (another instruction set) against the
scalar reference of its order, bitwise, with sentinels around the output."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm import cpu_kernels


def assert_equals_reference(
    run_into: Callable[[torch.Tensor, int], int],
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    m: int,
    seg: int,
    where: str,
) -> None:
    """``run_into(y, ldy)`` writes x[:m] @ w.T (+ bias) into y, rows ``ldy`` floats apart, and returns the
    kernel's status. y's rows are n + 16 floats apart, the padding and one row more a NaN sentinel:
    the product must equal ``rows_linear_reference`` bitwise, and nothing past column n or row m may be
    written."""
    n = w.shape[0]
    y = torch.full((m + 1, n + 16), float("nan"))
    assert run_into(y, n + 16) == 0, f"{where}: the kernel refused the call"
    want = cpu_kernels.rows_linear_reference(x[:m].contiguous(), w, bias, seg)
    assert torch.equal(y[:m, :n], want), f"{where}: != reference"
    assert y[:m, n:].isnan().all() and y[m].isnan().all(), f"{where}: written past column n or row m"
