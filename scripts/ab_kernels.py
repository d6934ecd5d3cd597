"""Session 8 A/B micro-benchmarks on the GPU (KERNEL_NOTES): the kernels of a prefill step and of
a tail step that the standard workload's profile pointed at, each variant beside the old one.

    PYTHONPATH=. python3 scripts/ab_kernels.py [--quick]

1. qk_norm_rope at 8,192 tokens (a prefill step) and 23 tokens (a tail step): one head per
   program (the old kernel's grid, BLOCK_H=1) against runs of 4/8/16/32 heads.
2. Prefill attention on the steps the scheduler makes of the workload's prompts (8,192-token
   budget, chunked): the key-walk flags (SPLIT_MASK, TILE_BLOCK) and tile configs.
3. The decode-batch linear kernel against cuBLAS (F.linear) on Qwen3-0.6B's four layer shapes
   at 1-64 rows: timed inside a CUDA graph over 8 copies of each weight (96+ MB, past the L2),
   as the engine's graphs run them; a config sweep at 23 rows.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from nanovllm.attention import triton_ops as ops
from nanovllm.bench.workloads import gpu_workload
from nanovllm.layers import fused_ops, skinny_gemm
from nanovllm.layers.rotary_embedding import RotaryEmbedding

HQ, HK, D = 16, 8, 128


def qk_rope() -> None:
    print("## qk_norm_rope (Qwen3-0.6B: 16 q + 8 k heads of 128, bf16), do_bench median")
    rope = RotaryEmbedding(D, 4096, 1e6).cuda()
    cos, sin = rope.cos.float(), rope.sin.float()
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    for t in (8192, 23):
        qkv = torch.randn(t, (HQ + 2 * HK) * D, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 4000, (t,), device="cuda")
        ref = None
        for bh in (1, 4, 8, 16, 32):
            fused_ops.QK_HEADS_PER_PROGRAM = bh
            fn = lambda pos=pos, qkv=qkv: fused_ops.qk_norm_rope(pos, qkv, HQ, HK, (w, 1e-6), (w, 1e-6), cos, sin)  # noqa: E731
            out = fn()
            ref = out if ref is None else ref
            same = torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
            us = do_bench(fn, warmup=25, rep=100) * 1e3
            print(f"qk_norm_rope T={t:5d} heads/program {bh:2d}: {us:7.1f} us  equal to 1-head: {same}", flush=True)
    fused_ops.QK_HEADS_PER_PROGRAM = 16


def prefill_steps(limit: int) -> list[list[tuple[int, int]]]:
    """(cached prefix, new tokens) per sequence of the first ``limit`` prefill steps: prompts in
    order, 8,192 tokens per step, the last one of a step chunked (the scheduler's packing)."""
    lens = [len(p) for p in gpu_workload().prompts]
    steps, cur, room, done = [], [], 8192, [0] * len(lens)
    i = 0
    while i < len(lens) and len(steps) < limit:
        take = min(room, lens[i] - done[i])
        cur.append((done[i], take))
        done[i] += take
        room -= take
        if done[i] == lens[i]:
            i += 1
        if room == 0:
            steps.append(cur)
            cur, room = [], 8192
    return steps


def paged(specs: list[tuple[int, int]], block_size: int = 256):
    gen = torch.Generator().manual_seed(0)
    totals = [c + q for c, q in specs]
    tables, nxt = [], 0
    for n in totals:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    perm = torch.randperm(nxt, generator=gen).tolist()
    tables = [[perm[b] for b in t] for t in tables]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    k = torch.randn(nxt, block_size, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qs = [q for _, q in specs]
    qsl = torch.tensor([0, *itertools.accumulate(qs)], dtype=torch.int32, device="cuda")
    sl = torch.tensor(totals, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(qs), HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, qsl, sl, bt


def prefill(limit: int) -> None:
    steps = prefill_steps(limit)
    cases = [paged(s) for s in steps]
    pairs = sum(q * c + q * (q + 1) / 2 for s in steps for c, q in s)
    flops = 4 * D * HQ * pairs
    print(f"## prefill attention over the first {len(steps)} prefill steps of the workload ({flops / 1e9:.0f} GFLOP)")
    ref = None
    for flags in ((False, False), (True, False), (False, True), (True, True)):
        for cfg in (
            None,
            ops.KernelConfig(128, 64, 4, 3),
            ops.KernelConfig(64, 64, 4, 3),
            ops.KernelConfig(128, 128, 8, 2),
            ops.KernelConfig(128, 32, 4, 3),
        ):
            ops.PREFILL_FLAG_OVERRIDES.update(SPLIT_MASK=flags[0], TILE_BLOCK=flags[1])
            outs = [torch.empty_like(c[0]) for c in cases]

            def fn(outs=outs, cfg=cfg):
                for (q, k, v, qsl, sl, bt), out in zip(cases, outs):
                    ops.paged_prefill(q, k, v, qsl, sl, bt, D**-0.5, out=out, config=cfg)

            fn()
            torch.cuda.synchronize()
            diff = 0.0 if ref is None else max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref))
            ref = ref or [o.clone() for o in outs]
            ms = do_bench(fn, warmup=5, rep=60)
            tag = "default" if cfg is None else f"M{cfg.block_m} N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            print(
                f"prefill split_mask={flags[0]:d} tile_block={flags[1]:d} {tag:18s}: {ms * 1e3 / len(steps):7.0f} us/step "
                f"{flops / ms / 1e9:6.0f} TFLOP/s  max diff {diff:.2e}",
                flush=True,
            )
    ops.PREFILL_FLAG_OVERRIDES.clear()


def graph_time(fn, reps: int = 4) -> float:
    """Seconds per call of ``fn(i)`` for i in 0..7, replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(8):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for i in range(8):
                fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / (reps * 8))
    return sorted(times)[len(times) // 2]


SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def skinny(quick: bool) -> None:
    print("## decode-batch linear layers: cuBLAS (F.linear) vs the Triton kernel, CUDA graph over 8 weight copies")
    weights = {
        name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        for name, (n, k) in SHAPES.items()
    }
    best: dict[str, skinny_gemm.SkinnyConfig] = {}
    configs = [
        skinny_gemm.SkinnyConfig(bn, bk, 4, st)
        for bn in (16, 32, 64)
        for bk in (128, 256, 512)
        for st in ((3, 5) if quick else (3, 4, 5))
    ]
    for name, (_n, k) in SHAPES.items():
        x = torch.randn(23, k, device="cuda", dtype=torch.bfloat16)
        ws = weights[name]
        results = []
        for cfg in configs:
            try:
                t = graph_time(lambda i, x=x, ws=ws, cfg=cfg: skinny_gemm.linear(x, ws[i], cfg))
            except Exception as e:  # out of shared memory, etc.
                print(f"  {name} {cfg}: failed ({type(e).__name__})")
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        best[name] = results[0][1]
        top = ", ".join(f"N{c.block_n} K{c.block_k} s{c.num_stages} {t * 1e6:.2f}" for t, c in results[:4])
        print(f"sweep {name} M=23: best {top} us", flush=True)
    print("| shape | rows | weight MB | cuBLAS us | default cfg us | best cfg us | best TB/s | max diff |")
    for name, (n, k) in SHAPES.items():
        ws = weights[name]
        mb = n * k * 2 / 1e6
        for m in (1, 8, 23, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cublas = graph_time(lambda i, x=x, ws=ws: F.linear(x, ws[i]))
            t_def = graph_time(lambda i, x=x, ws=ws: skinny_gemm.linear(x, ws[i]))
            t_best = graph_time(lambda i, x=x, ws=ws, c=best[name]: skinny_gemm.linear(x, ws[i], c))
            diff = (skinny_gemm.linear(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            print(
                f"| {name} | {m} | {mb:.1f} | {t_cublas * 1e6:.2f} | {t_def * 1e6:.2f} | {t_best * 1e6:.2f} "
                f"({best[name].block_n}/{best[name].block_k}/s{best[name].num_stages}) | {mb / 1e6 / t_best:.2f} | {diff:.1e} |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prefill-steps", type=int, default=6)
    p.add_argument("--only", choices=["qk", "prefill", "skinny"])
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.perf_counter()
    if args.only in (None, "qk"):
        qk_rope()
    if args.only in (None, "prefill"):
        prefill(args.prefill_steps)
    if args.only in (None, "skinny"):
        skinny(args.quick)
    print(f"# {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
