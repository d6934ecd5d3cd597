"""The rows kernel's K segments at the exact boundaries of their rule (K = 512 and K = 1,024).

``cpu_linear.segment``: "nowhere up to K = 512, every 512 up to 1,024, every 1,024 beyond", which is
oneDNN's float32 summation order on the development machines. The existing shapes have K = 576,
700, 1,100, 1,536, 3,072: inside the pieces, never on a boundary, where a ``<`` for ``<=`` moves
K = 1,024 (Qwen3-0.6B's hidden size) to another order and the float32 CPU engine's products leave
oneDNN's bits. The expected segments are the docstring's rule; the bitwise check compares with
oneDNN itself where this machine's oneDNN sums in that order (else it is skipped).
"""

from __future__ import annotations

import pytest
import torch

from nanovllm import cpu_kernels
from nanovllm.layers import cpu_linear

# K -> its segment, read off the documented rule at and next to each boundary
DOCUMENTED = {1: 1, 64: 64, 511: 511, 512: 512, 513: 512, 1000: 512, 1023: 512, 1024: 512, 1025: 1024, 4096: 1024}


def test_segment_at_the_boundaries_of_its_rule():
    got = {k: cpu_linear.segment(k) for k in DOCUMENTED}
    assert got == DOCUMENTED


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT)
    return cpu_linear.onednn_product(x, packed, None, pair=x.shape[0] == 1)


@pytest.mark.skipif(not cpu_linear.rows_enabled() or not cpu_linear.available(), reason="no rows kernel / oneDNN")
@pytest.mark.parametrize("k", [512, 1024, 1025])
def test_the_rows_kernel_gives_onednns_bits_at_a_boundary_k(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(48, k, generator=g) / k**0.5
    x = torch.randn(9, k, generator=g)
    rows = [1, 2, 9]
    # oneDNN's order here, told by the scalar reference (not by the kernel) at the documented segment
    if not all(
        torch.equal(cpu_kernels.rows_linear_reference(x[:m], w, None, DOCUMENTED.get(k, 1024)), _onednn(x[:m], w))
        for m in rows
    ):
        pytest.skip(f"this machine's oneDNN sums K={k} in another order than the development machine's")
    packed = cpu_linear.RowsWeight(w)
    differ = [m for m in rows if not torch.equal(cpu_linear.linear(x[:m], w, None, packed), _onednn(x[:m], w))]
    assert not differ, f"K={k}: the rows kernel differs from oneDNN at {differ} rows"
