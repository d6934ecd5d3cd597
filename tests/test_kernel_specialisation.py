"""Kernels never specialise on the alignment of metadata pointers (block tables, lengths, slots,
per-row sampling parameters): those point into per-step buffers at offsets whose 16-byte
alignment changes with the batch, and every alignment pattern would be one more compile, some of
them in the middle of a run. The GPU test tests/gpu/test_no_jit_after_startup.py checks the
outcome (nothing compiles after start-up); this checks the decorators on any machine with Triton."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton", reason="the kernels need triton")

from nanovllm.attention import triton_ops  # noqa: E402
from tests.kernel_modules import kernel_modules  # noqa: E402

PER_ROW = {"inv_temp_ptr", "seed_ptr", "token_ptr", "nonfinite_ptr", "val_ptr", "idx_ptr", "bad_ptr"}


def _kernels():
    for module in kernel_modules():  # every module with a kernel, not a list that can miss one
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction):
                yield f"{module.__name__}.{name}", obj


def _unspecialised_params(kernel) -> set[str]:
    return {p.name for p in kernel.params if p.do_not_specialize_on_alignment}


def test_metadata_pointers_are_not_aligned_specialisations():
    kernels = dict(_kernels())
    assert {
        "nanovllm.attention.triton_ops._prefill_kernel",
        "nanovllm.layers.fused_sampler._sample_kernel",
        "nanovllm.layers.fused_sampler._sample_merge_kernel",
        "nanovllm.layers.fused_ops._qk_norm_rope_kernel",
        "nanovllm.layers.decode_gemm._decode_gemm_kernel",
    } <= set(kernels), sorted(kernels)
    for name, kernel in kernels.items():
        params = set(inspect.signature(kernel.fn).parameters)
        metadata = params & (set(triton_ops.METADATA_PTRS) | PER_ROW)
        missing = metadata - _unspecialised_params(kernel)
        assert not missing, f"{name} specialises on the alignment of {sorted(missing)}"


STEP_VARYING = {"stride_bt", "num_seqs"}


def _specialised_step_integers(kernel) -> set[str]:
    params = set(inspect.signature(kernel.fn).parameters)
    return (params & STEP_VARYING) - {p.name for p in kernel.params if p.do_not_specialize}


def test_step_varying_integers_are_not_specialised():
    """The block-table stride (the widest table of an eager step) and the sequence count change
    from step to step: a kernel that takes them must not compile a variant per value class
    (1, multiples of 16, others)."""
    for name, kernel in _kernels():
        specialised = _specialised_step_integers(kernel)
        assert not specialised, f"{name} specialises on {sorted(specialised)}"


def test_the_check_sees_a_specialised_stride():
    """Negative control: a kernel that specialises on the block-table stride is reported, and
    the same kernel with the decorator is not."""

    def body(block_tables_ptr, stride_bt):
        pass

    assert _specialised_step_integers(triton.jit(body)) == {"stride_bt"}
    assert _specialised_step_integers(triton.jit(do_not_specialize=["stride_bt"])(body)) == set()


def test_the_check_sees_a_specialised_pointer():
    """Negative control: a kernel that does specialise on a metadata pointer is reported."""

    @triton.jit
    def bad(seq_lens_ptr, out_ptr):
        pass

    assert "seq_lens_ptr" not in _unspecialised_params(bad)
