"""What the fused sampler compiles to for an H100/H200 (offline, no GPU): one Philox evaluation per
four tokens and one approximate log2 per token (the outer log of the Gumbel noise; the inner one
stays libdevice's), not a Philox and two libdevice logarithms per token.

At batch 129 of the standard GPU workload the sampler took ~157 us of a 5.1 ms decode step
(KERNEL_NOTES session 13), bound by its arithmetic: ``tl.rand`` runs a whole Philox per token and keeps
one of its four words, and ``tl.log`` is a ~25-instruction polynomial. The counts below are per
thread and tile in the PTX; a kernel that spreads a four-token group over several threads (a
``[BLOCK / 4, 4]`` load whose layout puts the group's tokens in different threads) runs the group's
Philox in each of them, which this catches as well.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="the kernels need triton")
tl = pytest.importorskip("triton.language")

from nanovllm.layers import fused_sampler  # noqa: E402

BLOCK, WARPS = 4096, 8  # the wrapper's tile and warps for a 152k vocabulary
TOKENS_PER_THREAD = BLOCK // (32 * WARPS)
PHILOX_MULHI = 20  # ten rounds, two high multiplies each
SIGNATURE = {
    "logits_ptr": "*bf16", "stride_row": "i32", "inv_temp_ptr": "*fp32", "seed_ptr": "*i64", "val_ptr": "*fp32",
    "idx_ptr": "*i64", "bad_ptr": "*i64", "chunk": "i32", "num_splits": "i32", "VOCAB": "constexpr",
    "BLOCK": "constexpr", "SPLIT": "constexpr", "FAST_LOG": "constexpr", "PDL": "constexpr",
}  # fmt: skip


def _ptx(kernel, fast_log: bool = True) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"VOCAB": 151936, "BLOCK": BLOCK, "SPLIT": True, "PDL": False}
    signature = dict(SIGNATURE)
    if "FAST_LOG" in kernel.arg_names:
        constexprs["FAST_LOG"] = fast_log
    else:
        signature.pop("FAST_LOG")
    hints = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}  # the logits rows, as at run time
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=hints)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS}).asm["ptx"]


def _counts(ptx: str) -> tuple[int, int]:
    return ptx.count("mul.hi"), ptx.count("lg2.approx")


def test_one_philox_per_four_tokens_and_the_fast_log2():
    mulhi, lg2 = _counts(_ptx(fused_sampler._sample_kernel))
    assert mulhi <= PHILOX_MULHI * TOKENS_PER_THREAD // 4, mulhi
    assert lg2 == TOKENS_PER_THREAD, lg2  # the outer log only: the inner one stays exact
    assert "lg2.approx" not in _ptx(fused_sampler._sample_kernel, fast_log=False)  # the interpreter's path


@triton.jit
def _per_token_philox_kernel(
    logits_ptr, stride_row, inv_temp_ptr, seed_ptr, val_ptr, idx_ptr, bad_ptr, chunk, num_splits,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The kernel before session 13, in brief: a Philox and two libdevice logs per token."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * chunk + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < VOCAB, other=0.0).to(tl.float32)
    score = x * tl.load(inv_temp_ptr + row) - tl.log(-tl.log(tl.rand(tl.load(seed_ptr + row), cols)))
    tl.store(val_ptr + row, tl.max(score, axis=0))


def test_the_count_rejects_a_philox_per_token():
    """Negative control: the per-token kernel exceeds the Philox bound."""
    mulhi, _ = _counts(_ptx(_per_token_philox_kernel))
    assert mulhi > PHILOX_MULHI * TOKENS_PER_THREAD // 4, mulhi
