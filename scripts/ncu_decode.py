"""The decode attention kernel alone, as a tail step of the standard GPU run launches it, for Nsight
Compute (``ncu``) to read its hardware counters (KERNEL_NOTES session 25).

One layer's decode attention at batch ``--batch`` with contexts spread around ``--context`` (the
Qwen3-0.6B shape: 16 query heads, 8 KV heads, head_dim 128, 256-slot blocks, the cache head-major
and the blocks shuffled, as the engine's), the split factor the engine picks, a bf16 or FP8 cache.
It captures ``--launches`` calls of ``paged_decode`` in a CUDA graph, replays it three times and
prints the median time per call by CUDA events (the merge included where there are splits), so the
counters can be read against a figure taken without the profiler. Under ncu, ``--launch-skip 1``
skips the compiling call and profiles the first replayed kernel.

    PYTHONPATH=. python3 scripts/ncu_decode.py --kv fp8 --batch 129
    PYTHONPATH=. python3 scripts/ncu_decode.py --tile shipped,128x4x3x128 --batch 64,129,256   # A/B, "best tile"
    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 1 --launch-count 1 \\
        --set full python3 scripts/ncu_decode.py --kv fp8 --batch 129 --launches 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from nanovllm.attention import triton_ops as ops

HQ, HK, D, BLOCK = 16, 8, 128, 256


def tail_step(batch: int, context: int, kv: str, seed: int = 0, device: str = "cuda"):
    """q, caches, block tables and lengths of one decode step: contexts uniform in
    [context / 2, 3 context / 2), the blocks of all sequences shuffled over the cache."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context * 3 // 2, (batch,), generator=gen).tolist()
    blocks = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, nxt = [], 0
    for nb in blocks:
        tables.append(perm[nxt : nxt + nb])
        nxt += nb
    width = max(blocks)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    # head-major storage [blocks, kv heads, slots, d], seen slot-major as the kernels take it
    k, v = (
        torch.randn(nxt, HK, BLOCK, D, device=device, dtype=torch.bfloat16).to(dtype).permute(0, 2, 1, 3)
        for _ in range(2)
    )
    q = torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k, v, bt, sl


def parse_tile(spec: str) -> ops.KernelConfig | None:
    """``shipped`` (None: the engine's config) or ``NxWxS[xR]``: keys per tile, warps, stages and
    at most R registers per thread (``maxnreg``)."""
    if spec == "shipped":
        return None
    n, w, st, *reg = map(int, spec.split("x"))
    return ops.KernelConfig(16, n, w, st, reg[0] if reg else None)


def time_step(
    kv: str, batch: int, context: int, config: ops.KernelConfig | None, launches: int, splits: int | None = None
) -> tuple[float, float]:
    """Median microseconds per ``paged_decode`` call (the merge included) replayed from a CUDA graph,
    as the engine runs decode steps (a launch costs the host more than the kernel takes: an FP8
    cache's TMA descriptors are made on each call), and the TB/s of K/V bytes that makes."""
    q, k, v, bt, sl = tail_step(batch, context, kv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or ops.num_decode_splits(batch, HK, sms, kv_fp8=kv == "fp8")
    out = torch.empty_like(q)
    part = torch.empty(batch * HQ * splits * D, dtype=torch.float32, device="cuda")
    lse = torch.empty(batch * HQ * splits, dtype=torch.float32, device="cuda")

    def launch() -> None:
        ops.paged_decode(q, k, v, bt, sl, D**-0.5, num_splits=splits, workspace=(part, lse), out=out, config=config)

    launch()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    us = statistics.median(times)
    return us, int(sl.sum()) * HK * D * 2 * k.element_size() / us / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--batch", default="129", help="sequences in the step, N[,N...] (129: session 20's tail step)")
    p.add_argument("--context", type=int, default=1058, help="mean context length (1,058 at batch 129)")
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--wide", type=int, default=None, help="force the kernel's WIDE_MMA (0..3)")
    p.add_argument("--tile", default="shipped", help="shipped or NxWxS[xR], comma-separated: the configs to time")
    p.add_argument("--splits", default="", help="split factors N[,N...] to time instead of the engine's choice")
    args = p.parse_args()
    if args.wide is not None:
        ops.DECODE_FLAG_OVERRIDES["WIDE_MMA"] = args.wide
    total: dict[str, float] = {}
    for spec in args.tile.split(","):
        config = parse_tile(spec)
        for batch in map(int, args.batch.split(",")):
            for splits in [int(n) for n in args.splits.split(",") if n] or [None]:
                us, tbs = time_step(args.kv, batch, args.context, config, args.launches, splits)
                total[spec] = total.get(spec, 0.0) + us
                how = f"splits {splits}" if splits else "the engine's splits"
                print(f"decode {args.kv} {spec} batch {batch} {how}: {us:.1f} us (with the merge), {tbs:.2f} TB/s")
    if len(total) > 1:
        best = min(total, key=total.__getitem__)
        print(
            f"best tile {best} ({total[best]:.1f} us over the batches; shipped {total.get('shipped', float('nan')):.1f})"
        )


if __name__ == "__main__":
    main()
