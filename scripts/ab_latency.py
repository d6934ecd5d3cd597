"""Session 12's latency A/B on the GPU: time per output token at batch 1, 4, 8 and 16 with the
decode-batch GEMM (``layers/decode_gemm.py``) on or off, Qwen3-0.6B's shape with random weights
(``nanovllm bench latency`` needs a checkpoint; this uses the GPU workload's shape).

    PYTHONPATH=. python3 scripts/ab_latency.py on|off [--rows N] [--inspect]

``--rows N``: the most rows the Triton products take (``decode_gemm.MAX_ROWS``; the shipped 4 leaves
batch 8 and 16 on cuBLAS either way, so those two compare nothing unless N is raised). Each batch size: 2 warm-up and 5 timed batches of fresh 32-token prompts, 128 tokens each
(``bench.latency.measure_batch_size``); prints p50 TPOT, TTFT and batch time. ``--inspect`` then
prints what Triton compiled for the decode attention kernel at run time (cp.async copies, shared
memory): offline compiles without the run time's divisibility hints show no pipelining.
"""

from __future__ import annotations

import os
import re
import sys

TILE_COPY = r"cp\.async\.c[ag]\.shared\.global[^;]*0x10"  # per-thread 16-byte copies: tile data


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=["on", "off"])
    p.add_argument("--rows", type=int, default=None, help="decode_gemm.MAX_ROWS for this run")
    p.add_argument("--inspect", action="store_true", help="print the decode kernel's compiled variants")
    args = p.parse_args()
    variant = args.variant
    os.environ["NANOVLLM_DECODE_GEMM"] = "1" if variant == "on" else "0"
    if args.rows is not None:
        from nanovllm.layers import decode_gemm

        decode_gemm.MAX_ROWS = args.rows
    from nanovllm import LLM
    from nanovllm.bench.latency import measure_batch_size
    from nanovllm.bench.workloads import shape_config_dir

    llm = LLM(shape_config_dir("qwen3-0.6b"), load_format="dummy", max_model_len=4096)
    vocab = llm.llm_engine.vocab_size
    for b in (1, 4, 8, 16):
        s = measure_batch_size(llm, b, 32, 128, 5, 2, vocab).summary()
        print(
            f"{variant} batch {b}: TPOT p50 {s['tpot_ms']['p50']:.3f} ms  TTFT p50 {s['ttft_ms']['p50']:.2f} ms  "
            f"batch p50 {s['batch_ms']['p50']:.1f} ms",
            flush=True,
        )
    if args.inspect:
        from nanovllm.attention import triton_ops

        for caches in triton_ops._decode_kernel.device_caches.values():
            for part in caches if isinstance(caches, tuple) else [caches]:
                for k in part.values() if isinstance(part, dict) else []:
                    ptx = getattr(k, "asm", {}).get("ptx", "")
                    if ptx:
                        print(
                            "decode kernel variant: 16-byte cp.async", len(re.findall(TILE_COPY, ptx)),
                            "ld.global", ptx.count("ld.global"), "bulk.tensor", ptx.count("cp.async.bulk.tensor"),
                            "smem", k.metadata.shared, "warps", k.metadata.num_warps, "stages", k.metadata.num_stages,
                        )  # fmt: skip
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
