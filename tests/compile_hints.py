"""The divisibility hints Triton specializes on at run time, for offline sm_90 compiles in the tests.

Triton compiles a kernel per specialization of its arguments: pointers aligned to 16 bytes and
integers divisible by 16 are marked ``tt.divisibility`` 16, and only then does it pipeline loads with
``cp.async`` and vectorize them. An offline compile without the hints is not the kernel the engine
runs (KERNEL_NOTES session 12: the bf16 decode kernel compiled without them showed no pipelining at
all). ``runtime_hints`` marks what the engine passes aligned at the benchmark shape: the data pointers
and every stride. The metadata pointers are never specialized on alignment
(tests/test_kernel_specialisation.py); a stride such as the block-table row width is divisible by
16 only for some ``max_model_len``, so a compile with these hints is the benchmark's kernel.
"""

from __future__ import annotations

METADATA_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}  # int32, never aligned-specialized


def runtime_hints(kernel) -> dict:
    """``attrs`` for ``triton.compiler.ASTSource``: ``tt.divisibility`` 16 on the kernel's data
    pointers (``*_ptr`` but the metadata) and its strides (``stride*``)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(kernel.params)
        if (p.name.endswith("_ptr") and p.name not in METADATA_POINTERS) or p.name.startswith("stride")
    }
