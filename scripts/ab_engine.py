"""Session 8's engine A/B: run ``nanovllm bench`` (arguments after the variant) with the new
kernels on or with the old behaviour restored in this process (KERNEL_NOTES session 8).

    PYTHONPATH=. python3 scripts/ab_engine.py {old,new,noskinny} bench --workload gpu ...

old:      qk_norm_rope one head per program, the prefill kernel without SPLIT_MASK/TILE_BLOCK,
          cuBLAS for every linear layer (the code before session 8);
noskinny: the new qk_norm_rope and prefill walk, cuBLAS for every linear layer;
new:      everything as shipped.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    variant, argv = sys.argv[1], sys.argv[2:]
    if variant not in ("old", "new", "noskinny"):
        raise SystemExit(f"variant must be old, new or noskinny, got {variant!r}")
    if variant in ("old", "noskinny"):
        os.environ["NANOVLLM_SKINNY_GEMM"] = "0"
    if variant == "old":
        from nanovllm.attention import triton_ops
        from nanovllm.layers import fused_ops

        fused_ops.QK_HEADS_PER_PROGRAM = 1
        triton_ops.PREFILL_FLAG_OVERRIDES.update(SPLIT_MASK=False, TILE_BLOCK=False)
    from nanovllm.entrypoints.cli import main as cli

    print(f"# variant {variant}", flush=True)
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
