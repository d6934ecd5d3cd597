"""The decode attention kernel alone, as a tail step of the standard GPU run launches it, for Nsight
Compute (``ncu``) to read its hardware counters, and for A/B timings of its configs (KERNEL_NOTES
session 25).

One layer's decode attention at batch ``--batch`` with contexts spread around ``--context`` (the
Qwen3-0.6B shape: 16 query heads, 8 KV heads, head_dim 128, 256-slot blocks, the cache head-major
and the blocks shuffled, as the engine's), a bf16 or FP8 cache, at the split factor the engine picks
or at each of ``--splits``. Each (config, batch, splits) is run once (compiled), then timed from a
CUDA graph of ``--launches`` calls (``ab_kernels.graph_us``: the engine replays its decode steps;
timing the calls would time the host), so the counters can be read against a figure taken without
the profiler. Under ncu, ``--launch-skip 1`` skips the compiling call and profiles a replayed kernel.

    PYTHONPATH=. python3 scripts/ncu_decode.py --kv fp8 --batch 129
    PYTHONPATH=. python3 scripts/ncu_decode.py --tile shipped,128x4x3x128 --batch 64,129,256   # A/B
    PYTHONPATH=. python3 scripts/ncu_decode.py --tile shipped,streamk --batch 32,64,129,256
    PYTHONPATH=. python3 scripts/ncu_decode.py --tile shipped,streamk --v-pairs 0,1 --batch 16,64,129,256
    PYTHONPATH=. python3 scripts/ncu_decode.py --batch 129,258 --splits 1,2,4
    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 1 --launch-count 1 \\
        --set full python3 scripts/ncu_decode.py --kv fp8 --batch 129 --launches 2
"""

from __future__ import annotations

import argparse

import torch
import triton

from nanovllm.attention import decode_streamk
from nanovllm.attention import triton_ops as ops
from scripts.ab_kernels import graph_us, head_major, paged

HQ, HK, D, BLOCK = 16, 8, 128, 256


def tail_step(batch: int, context: int, kv: str, seed: int = 0, device: str = "cuda"):
    """q, caches (head-major storage seen slot-major, as the kernels take it), block tables and
    lengths of one decode step: contexts uniform in [context / 2, 3 context / 2), the blocks of all
    sequences shuffled over the cache (``ab_kernels.paged``)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context * 3 // 2, (batch,), generator=gen).tolist()
    q, k, v, _, sl, bt = paged([(n - 1, 1) for n in lens], BLOCK, device=device, seed=seed)
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    return q, head_major(k.to(dtype)), head_major(v.to(dtype)), bt, sl


def parse_tile(spec: str) -> ops.KernelConfig | None:
    """``shipped`` or ``streamk`` (None: the engine's config; ``streamk`` times
    ``decode_streamk.paged_decode_streamk`` with its own) or ``NxWxS[xR]``: keys per tile, warps,
    stages and at most R registers per thread (``maxnreg``), for the shipped kernel."""
    if spec in ("shipped", "streamk"):
        return None
    n, w, st, *reg = map(int, spec.split("x"))
    return ops.KernelConfig(16, n, w, st, reg[0] if reg else None)


def time_step(
    kv: str,
    batch: int,
    context: int,
    config: ops.KernelConfig | None,
    launches: int,
    splits: int | None = None,
    streamk: bool = False,
) -> tuple[float, float, int]:
    """Microseconds per ``paged_decode`` call (the merge included), the TB/s of K/V bytes that
    makes, and the split factor used (``splits``, or the engine's choice when None). ``streamk``:
    ``paged_decode_streamk`` instead, its tile map and merge included (``splits`` then counts its
    programs per SM)."""
    q, k, v, bt, sl = tail_step(batch, context, kv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty_like(q)
    if streamk:
        splits = splits or decode_streamk.PROGRAMS_PER_SM
        programs = splits * sms
        max_tiles = -(-bt.shape[1] * BLOCK // 32)  # room for the smallest tiles
        ws = decode_streamk.StreamKWorkspace.allocate(batch, max_tiles, HK, HQ // HK, D, programs, q.device)

        def launch() -> None:
            decode_streamk.paged_decode_streamk(q, k, v, bt, sl, D**-0.5, programs=programs, workspace=ws, out=out)

    else:
        splits = splits or ops.num_decode_splits(batch, HK, sms, kv_fp8=kv == "fp8")
        part = torch.empty(batch * HQ * splits * D, dtype=torch.float32, device="cuda")
        lse = torch.empty(batch * HQ * splits, dtype=torch.float32, device="cuda")

        def launch() -> None:
            ops.paged_decode(q, k, v, bt, sl, D**-0.5, num_splits=splits, workspace=(part, lse), out=out, config=config)

    launch()  # compiles
    torch.cuda.synchronize()
    us = graph_us(launch, launches)
    return us, int(sl.sum()) * HK * D * 2 * k.element_size() / us / 1e6, splits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--batch", default="129", help="sequences in the step, N[,N...] (129: session 20's tail step)")
    p.add_argument("--context", type=int, default=1058, help="mean context length (1,058 at batch 129)")
    p.add_argument("--launches", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--wide", type=int, default=None, help="force the kernel's WIDE_MMA (0..3)")
    p.add_argument(
        "--tile", default="shipped", help="shipped, streamk or NxWxS[xR], comma-separated: the configs to time"
    )
    p.add_argument(
        "--splits", default="", help="split factors N[,N...] instead of the engine's choice (streamk: programs per SM)"
    )
    p.add_argument(
        "--v-pairs", default="", help="0,1: time each config with an FP8 V read as bytes (0) and as int16 pairs (1)"
    )
    args = p.parse_args()
    if args.wide is not None:
        ops.DECODE_FLAG_OVERRIDES["WIDE_MMA"] = args.wide
    splits_list = [int(n) for n in args.splits.split(",") if n] or [None]
    total: dict[tuple[str, int | None], float] = {}  # (config, splits asked) -> us summed over the batches
    specs = [
        (f"{spec}/vpairs={v}" if v else spec, spec, v)
        for spec in dict.fromkeys(args.tile.split(","))
        for v in (args.v_pairs.split(",") if args.v_pairs else [""])
    ]
    for label, spec, v_pairs in specs:
        config = parse_tile(spec)
        if v_pairs:
            ops.DECODE_FLAG_OVERRIDES["V_PAIRS"] = v_pairs == "1"
        for asked in splits_list:
            for batch in map(int, args.batch.split(",")):
                try:
                    us, tbs, used = time_step(
                        args.kv, batch, args.context, config, args.launches, asked, streamk=spec == "streamk"
                    )
                except triton.runtime.errors.OutOfResources as e:  # shared memory: never the fastest
                    total[label, asked] = float("inf")
                    print(f"decode {args.kv} {label} batch {batch}: does not fit ({e})")
                    continue
                total[label, asked] = total.get((label, asked), 0.0) + us
                print(
                    f"decode {args.kv} {label} batch {batch} splits {used}: {us:.1f} us (with the merge), {tbs:.2f} TB/s"
                )
    if len(total) > 1:
        (spec, asked), us = min(total.items(), key=lambda kv: kv[1])
        how = f"splits {asked}" if asked else "the engine's splits"
        print(f"fastest: {spec} at {how}, {us:.1f} us summed over the batches")


if __name__ == "__main__":
    main()
