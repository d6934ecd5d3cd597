"""Session 8 A/B micro-benchmarks on the GPU (KERNEL_NOTES): the kernels of a prefill step and of
a tail step that the standard workload's profile pointed at, each variant beside the old one.

    PYTHONPATH=. python3 scripts/ab_kernels.py [--only qk|prefill|decode|layout|tiles|gemm]

1. qk_norm_rope at 8,192 tokens (a prefill step) and 23 tokens (a tail step): one head per
   program (the old kernel's grid, BLOCK_H=1) against runs of 4/8/16/32 heads.
2. Prefill attention on the steps the scheduler makes of the workload's prompts (8,192-token
   budget, chunked): the key-walk flags (SPLIT_MASK, TILE_BLOCK) and tile configs.
3. Decode attention on the decode steps of the workload (session 9): every 50th step's batch and
   contexts (the requests whose max_tokens exceed the step, each at prompt + step tokens), the
   split-K factor chosen for 2/4/8/16/32 programs per SM (``DECODE_SPLIT_WAVES``), bf16 and FP8
   caches; the sum over the sampled steps x 50 x 28 layers estimates the run's decode attention.
4. ``--only layout`` (session 9): slot-major against head-major caches; ``--only tiles`` (session
   10): the decode tile configs and TILE_BLOCK on the head-major bf16 cache; ``--only gemm``
   (session 12): the decode-batch linear layers, Triton with PDL against cuBLAS.

(Its first run also timed a Triton kernel for decode-sized linear layers against cuBLAS: it did
not win then, and was removed (KERNEL_NOTES session 8); session 12's ``--only gemm`` times its
successor, ``layers/decode_gemm.py``, launched with PDL.)
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
from triton.testing import do_bench

from nanovllm.attention import triton_ops as ops
from nanovllm.bench.workloads import gpu_workload
from nanovllm.layers import fused_ops
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


def paged(specs: list[tuple[int, int]], block_size: int = 256, device: str = "cuda", seed: int = 0):
    """q, K/V caches (slot-major, bf16), cumulative query starts, lengths and block tables for
    sequences of (context, new tokens) ``specs``, their blocks shuffled over the cache."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + q for c, q in specs]
    tables, nxt = [], 0
    for n in totals:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    perm = torch.randperm(nxt, generator=gen).tolist()
    tables = [[perm[b] for b in t] for t in tables]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    k = torch.randn(nxt, block_size, HK, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qs = [q for _, q in specs]
    qsl = torch.tensor([0, *itertools.accumulate(qs)], dtype=torch.int32, device=device)
    sl = torch.tensor(totals, dtype=torch.int32, device=device)
    q = torch.randn(sum(qs), HQ, D, device=device, dtype=torch.bfloat16)
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


def decode_steps(stride: int = 50) -> list[list[int]]:
    """Context lengths of the workload's decode steps, every ``stride``-th: the requests whose
    max_tokens exceed the step (all start decoding together, a close fit to the run's tail)."""
    w = gpu_workload()
    lens = [len(p) for p in w.prompts]
    steps = []
    for t in range(1, max(w.max_tokens), stride):
        ctx = [n + t for n, m in zip(lens, w.max_tokens) if m > t]
        if ctx:
            steps.append(ctx)
    return steps


def graph_us(fn, launches: int = 20) -> float:
    """Microseconds per call of ``fn`` (already run once: compiled), ``launches`` calls captured in a
    CUDA graph and replayed (do_bench median), as the engine replays its decode steps. Timing the
    calls themselves would time the host: a paged_decode call on an FP8 cache costs ~220-250 us of
    host time (its TMA descriptors are made on each call) for a ~115 us kernel at batch 129 on an
    H100 (session 25)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return do_bench(graph.replay, warmup=5, rep=50) * 1e3 / launches


def time_decode(
    q, kc, vc, bt, sl, splits: int, ref: torch.Tensor | None, config: ops.KernelConfig | None = None
) -> tuple[float, float, torch.Tensor]:
    """Microseconds per paged_decode call (``graph_us``), its output's largest distance from ``ref``,
    and the reference for the next variants (this output when ``ref`` is None, so the first
    variant's). Until session 25 this timed the calls with do_bench, host launch included."""
    out = torch.empty_like(q)
    part = torch.empty(q.shape[0] * q.shape[1] * splits * D, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[0] * q.shape[1] * splits, dtype=torch.float32, device=q.device)

    def fn():
        ops.paged_decode(q, kc, vc, bt, sl, D**-0.5, num_splits=splits, workspace=(part, lse), out=out, config=config)

    fn()
    ref = out.clone() if ref is None else ref
    diff = (out.float() - ref.float()).abs().max().item()
    return graph_us(fn), diff, ref


def decode(stride: int = 50) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    steps = decode_steps(stride)
    print(f"## decode attention over {len(steps)} decode steps of the workload (every {stride}th), from CUDA graphs")
    totals: dict[tuple[str, int], float] = {}
    for ctx in steps:
        q, k, v, _, sl, bt = paged([(c - 1, 1) for c in ctx])
        b = len(ctx)
        for kind in ("bf16", "fp8"):
            kc, vc = (k, v) if kind == "bf16" else (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
            gb = sum(ctx) * HK * D * 2 * kc.element_size() / 1e9
            ref = None
            line = []
            for waves in (2, 4, 8, 16, 32):
                splits = ops.num_decode_splits(b, HK, sms, waves)
                us, diff, ref = time_decode(q, kc, vc, bt, sl, splits, ref)
                totals[kind, waves] = totals.get((kind, waves), 0.0) + us * stride * 28 / 1e6
                line.append(f"w{waves}:s{splits} {us:6.1f}us {gb / us * 1e3:4.2f}TB/s d{diff:.0e}")
            print(f"decode b{b:3d} ctx {sum(ctx) // b:5d} {kind}: " + "  ".join(line), flush=True)
    for (kind, waves), s in sorted(totals.items()):
        print(f"decode run estimate {kind} waves {waves:2d}: {s:.3f} s of attention over the decode steps")


def head_major(x: torch.Tensor) -> torch.Tensor:
    """The same cache in the head-major layout [blocks, kv heads, slots, d], seen through the
    kernels' slot-major view [blocks, slots, kv heads, d] (they take strides)."""
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def layout(stride: int = 50) -> None:
    """Session 9: slot-major (each key's 8 heads side by side: a head's keys 2 KB apart) against
    head-major (a head's keys of a block contiguous), decode and prefill, bf16 and FP8."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("## cache layout: slot-major (now) vs head-major, decode from CUDA graphs, prefill do_bench median")
    totals: dict[str, float] = {}
    for ctx in decode_steps(stride):
        q, k, v, _, sl, bt = paged([(c - 1, 1) for c in ctx])
        b = len(ctx)
        line = []
        for kind in ("bf16", "fp8"):
            kc, vc = (k, v) if kind == "bf16" else (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
            gb = sum(ctx) * HK * D * 2 * kc.element_size() / 1e9
            ref = None
            for lay in ("slot", "head"):
                kk, vv = (kc, vc) if lay == "slot" else (head_major(kc), head_major(vc))
                for waves in (2, 8):
                    splits = ops.num_decode_splits(b, HK, sms, waves)
                    us, diff, ref = time_decode(q, kk, vv, bt, sl, splits, ref)
                    key = f"{kind} {lay} w{waves}"
                    totals[key] = totals.get(key, 0.0) + us * stride * 28 / 1e6
                    line.append(f"{lay[0]}w{waves} {us:6.1f}us {gb / us * 1e3:4.2f}TB/s d{diff:.0e}")
            print(f"layout decode b{b:3d} ctx {sum(ctx) // b:5d} {kind}: " + "  ".join(line[-4:]), flush=True)
    for key, t in sorted(totals.items()):
        print(f"layout decode run estimate {key}: {t:.3f} s")
    steps = prefill_steps(6)
    cases = [paged(s) for s in steps]
    for lay in ("slot", "head"):
        cs = [
            (q, k, v, qsl, sl, bt) if lay == "slot" else (q, head_major(k), head_major(v), qsl, sl, bt)
            for q, k, v, qsl, sl, bt in cases
        ]
        outs = [torch.empty_like(c[0]) for c in cs]

        def fn(cs=cs, outs=outs):
            for (q, k, v, qsl, sl, bt), out in zip(cs, outs):
                ops.paged_prefill(q, k, v, qsl, sl, bt, D**-0.5, out=out)

        fn()
        ms = do_bench(fn, warmup=5, rep=60)
        print(f"layout prefill {lay}-major: {ms * 1e3 / len(steps):7.0f} us/step", flush=True)
    t = 8192
    kk = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    for lay in ("slot", "head"):
        kc = torch.zeros(64, 256, HK, D, device="cuda", dtype=torch.bfloat16)
        kc = kc if lay == "slot" else head_major(kc)
        vc = torch.zeros_like(kc) if lay == "slot" else head_major(torch.zeros_like(kc))
        slots = torch.randperm(64 * 256, device="cuda")[:t]
        us = do_bench(lambda kc=kc, vc=vc, slots=slots: ops.store_kv(kk, kk, kc, vc, slots), warmup=10, rep=50) * 1e3
        print(f"layout store 8192 tokens {lay}-major: {us:6.1f} us", flush=True)


TILES = "64x4x3,64x4x2,64x4x4,64x8x3,32x4x3,128x4x3,128x4x2,128x8x3,128x8x2,256x8x2"


def tiles(configs: str = TILES, waves_list: str = "2", stride: int = 100, kv: str = "bf16", modes: str = "p,t") -> None:
    """Session 10: the decode kernel's tile config (keys per tile, warps, stages), TILE_BLOCK (one
    block-table entry per tile) and the split-K target (programs per SM) on the head-major bf16
    cache (the configs were last swept on the slot-major layout). Prints the run estimate per
    variant and, last, the best one as ``best tile NxWxS tb=0|1|2 waves=N`` (scripts read that line;
    tb=2 is TMA, ``ab_engine.py tma=1`` with ``tb=1``).
    ``kv="fp8"``: the same on an FP8 cache (its V widened by inline PTX, as shipped). ``modes``: how
    a tile is addressed, ``p`` one block-table entry per key, ``t`` TILE_BLOCK, ``m`` TILE_BLOCK with
    the tile copied by TMA (session 11); a variant's key says tb=0, 1 or 2 for the three."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(map(int, c.split("x"))) for c in configs.split(",")]
    waves_all = [int(w) for w in waves_list.split(",")]
    print(f"## decode tile configs, head-major {kv} cache, every {stride}th decode step, from CUDA graphs")
    totals: dict[tuple[int, int, int, bool, int], float] = {}
    for ctx in decode_steps(stride):
        q, k, v, _, sl, bt = paged([(c - 1, 1) for c in ctx])
        kc, vc = head_major(k), head_major(v)
        if kv == "fp8":
            kc, vc = head_major(k.to(torch.float8_e4m3fn)), head_major(v.to(torch.float8_e4m3fn))
        b = len(ctx)
        gb = sum(ctx) * HK * D * 2 * kc.element_size() / 1e9
        ref = None
        line = []
        worst = 0.0  # the largest distance of any variant's output from the first's
        for waves in waves_all:
            splits = ops.num_decode_splits(b, HK, sms, waves)
            for n, w, st in shapes:
                for mode in modes.split(","):
                    tb = "ptm".index(mode)  # 0 per key, 1 TILE_BLOCK, 2 TMA
                    ops.DECODE_FLAG_OVERRIDES.update(TILE_BLOCK=tb > 0, TMA=tb == 2)
                    try:
                        us, diff, ref = time_decode(q, kc, vc, bt, sl, splits, ref, ops.KernelConfig(16, n, w, st))
                    except triton.runtime.errors.OutOfResources:  # shared memory: counted as never best
                        us, diff = float("inf"), 0.0
                    worst = max(worst, diff)
                    key = (n, w, st, tb, waves)
                    totals[key] = totals.get(key, 0.0) + us * stride * 28 / 1e6
                    line.append(f"{n}x{w}x{st}{'ptm'[tb]}w{waves}s{splits} {gb / us * 1e3:4.2f}")
        ops.DECODE_FLAG_OVERRIDES.pop("TILE_BLOCK", None)
        ops.DECODE_FLAG_OVERRIDES.pop("TMA", None)
        print(f"tiles b{b:3d} ctx {sum(ctx) // b:5d} d{worst:.0e} TB/s: " + " ".join(line), flush=True)
    for key, t in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"tiles run estimate {key[0]}x{key[1]}x{key[2]} tb={int(key[3])} waves={key[4]}: {t:.3f} s")
    (n, w, st, tb, waves), _ = min(totals.items(), key=lambda kv: kv[1])
    print(f"best tile {n}x{w}x{st} tb={int(tb)} waves={waves}")


# the chain's output against cuBLAS's after 28 layers, bf16: session 12 saw up to 9e-2 from rounding alone
MAX_CHAIN_DIFF = 0.25
GEMMS = "cublas,32/16x256x4x3,pre32/16x16x8,pre32/16x16x8e,pre32/16x32x8e,pre32/16x16x4e,pre64/16x16x8e"


def gemm(configs: str = GEMMS, rows: str = "1,8,16,23,32,48,64,96,128,192,256") -> None:
    """Session 12: the decode-batch linear layers (``layers/decode_gemm.py``: Triton, PDL) against
    cuBLAS, in what surrounds them in a decode step:
    28 layers of RMSNorm -> qkv -> (SiLU-and-mul as the attention's stand-in, 4,096 -> 2,048) -> o_proj
    -> RMSNorm -> gate_up -> SiLU-and-mul -> down, each layer its own weights (Qwen3-0.6B's, 0.8 GB:
    past the L2), captured in one CUDA graph and replayed (do_bench median). The figure is per layer."""
    from nanovllm.layers import decode_gemm

    decode_gemm.MAX_ROWS = 1 << 30
    hidden, inter, qkv_n, layers = 1024, 3072, (HQ + 2 * HK) * D, 28
    dt = torch.bfloat16
    ws = [
        [
            torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
            for n, k in ((qkv_n, hidden), (hidden, HQ * D), (2 * inter, hidden), (hidden, inter))
        ]
        for _ in range(layers)
    ]
    norm_w = torch.ones(hidden, device="cuda", dtype=dt)
    print(f"## decode-batch linear layers, {layers} layers of Qwen3-0.6B in one CUDA graph, us per layer")
    times: dict[str, dict[int, float]] = {}
    for m in map(int, rows.split(",")):
        x0 = torch.randn(m, hidden, device="cuda", dtype=dt)
        line, ref = [], None
        for spec in configs.split(","):
            early = spec.startswith("pre") and spec.endswith("e")  # RMSNorm and SiLU release early
            if spec == "cublas":
                lin = lambda x, w: torch.nn.functional.linear(x, w)  # noqa: E731
            elif spec.startswith("pre"):  # session 16: the preloading kernel, BIG/SMALLxBMxW[e]
                pcfg = decode_gemm.parse_preload_config(spec[3 : len(spec) - early])
                lin = lambda x, w, pcfg=pcfg: decode_gemm.preload_linear(x, w, pcfg(*w.shape))  # noqa: E731
            else:
                cfg = decode_gemm.parse_config(spec)
                lin = lambda x, w, cfg=cfg: decode_gemm.linear(x, w, cfg(*w.shape))  # noqa: E731

            def step(lin=lin, x0=x0, early=early):
                h, res = x0, x0
                for wq, wo, wgu, wd in ws:
                    n1, res = fused_ops.rms_norm(h, norm_w, 1e-6, res)
                    fused_ops.EARLY_RELEASE = False  # the attention stand-in: attention never releases early
                    a = fused_ops.silu_and_mul(lin(n1, wq))
                    fused_ops.EARLY_RELEASE = early
                    n2, res = fused_ops.rms_norm(lin(a, wo), norm_w, 1e-6, res)
                    h = lin(fused_ops.silu_and_mul(lin(n2, wgu)), wd)
                return h

            fused_ops.EARLY_RELEASE = early
            try:
                step()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
                fused_ops.EARLY_RELEASE = False
                graph.replay()
                torch.cuda.synchronize()
                diff = 0.0 if ref is None else float((out.float() - ref.float()).abs().max())
                ref = out.clone() if ref is None else ref
                us = do_bench(graph.replay, warmup=10, rep=100) * 1e3 / layers
                if diff <= MAX_CHAIN_DIFF:  # a config whose output is off (a bug, a race) is never best
                    times.setdefault(spec, {})[m] = us
                line.append(f"{spec} {us:6.2f} (d{diff:.0e}{'' if diff <= MAX_CHAIN_DIFF else ' WRONG'})")
            except Exception as e:  # a config that does not compile or fit: reported, never best
                fused_ops.EARLY_RELEASE = False
                line.append(f"{spec} failed: {type(e).__name__}: {str(e)[:80]}")
        print(f"gemm M={m:3d}: " + "  ".join(line), flush=True)
    # the best Triton config: the most rows up to which it beats cuBLAS at every batch size, then the
    # most time saved there (scripts read this line: ab_engine.py gemm=1,gemmrows=N,gemmcfg=CFG)
    base = times.get("cublas", {})
    best, best_pre = None, None
    for spec, by_m in times.items():
        if spec == "cublas":
            continue
        upto, saved = 0, 0.0
        for m in sorted(by_m):
            if m not in base or by_m[m] >= base[m]:
                break
            upto, saved = m, saved + base[m] - by_m[m]
        if upto and (best is None or (upto, saved) > best[:2]):
            best = (upto, saved, spec)
        if upto and spec.startswith("pre") and (best_pre is None or (upto, saved) > best_pre[:2]):
            best_pre = (upto, saved, spec)
    print(f"best gemm {best[2]} rows={best[0]} saved={best[1]:.2f}" if best else "best gemm none")
    # the preloading kernel's best (session 16: ab_engine.py pre=N,precfg=CFG[,early=1])
    print(f"best preload {best_pre[2]} rows={best_pre[0]} saved={best_pre[1]:.2f}" if best_pre else "best preload none")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prefill-steps", type=int, default=6)
    p.add_argument("--only", choices=["qk", "prefill", "decode", "layout", "tiles", "gemm"])
    p.add_argument(
        "--gemms", default=GEMMS, help="configs for --only gemm: cublas, BIG/SMALLxBKxWxS or preBIG/SMALLxBMxW[e],..."
    )
    p.add_argument("--rows", default="1,8,16,23,32,48,64,96,128,192,256", help="batch sizes for --only gemm")
    p.add_argument("--tiles", default=TILES, help="decode configs for --only tiles: NxWxS,...")
    p.add_argument("--waves", default="2", help="split-K targets (programs per SM) for --only tiles: N,...")
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="the cache type for --only tiles")
    p.add_argument(
        "--modes", default="p,t", help="tile addressing for --only tiles: p (per key), t (TILE_BLOCK), m (TMA)"
    )
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.perf_counter()
    if args.only in (None, "qk"):
        qk_rope()
    if args.only in (None, "prefill"):
        prefill(args.prefill_steps)
    if args.only in (None, "decode"):
        decode()
    if args.only == "layout":
        layout()
    if args.only == "tiles":
        tiles(args.tiles, args.waves, kv=args.kv, modes=args.modes)
    if args.only == "gemm":
        gemm(args.gemms, args.rows)
    print(f"# {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
