"""Micro-benchmarks of the Triton attention kernels and of one engine decode step (GPU only).

Decode: batch 256, context 1024, Qwen3-0.6B attention shape (16 query heads,
8 KV heads, head_dim 128, bf16): achieved bandwidth on the K/V bytes it must
read, against the ~4.3 TB/s the H200 machine copies at. Prefill: TFLOP/s of the
causal attention FLOPs, beside torch's SDPA (FlashAttention) on contiguous K/V.
Timing: triton.testing.do_bench (CUDA events, L2 flushed, median) after warm-up.

    PYTHONPATH=. python3 scripts/bench_kernels.py [--engine] [--sampler-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import triton
from triton.testing import do_bench

from nanovllm.attention import triton_ops as ops

HBM = 4.3e12  # bytes/s, measured device copy on the H200 machine
PEAK_FLOPS = 790e12  # bf16 dense matmul, measured
H, KVH, D = 16, 8, 128
ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"{name:44s} {value:>14s}  {note}", flush=True)


def paged_cache(seq_lens: list[int], block_size: int, gen: torch.Generator):
    tables, nxt = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    perm = torch.randperm(nxt, generator=gen).tolist()  # scatter blocks over the cache
    tables = [[perm[b] for b in t] for t in tables]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    k = torch.randn(nxt, block_size, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return k, v, bt


def bench_decode(batch: int, ctx: int, block_size: int, splits: int, cfg: ops.KernelConfig | None):
    gen = torch.Generator().manual_seed(0)
    k, v, bt = paged_cache([ctx] * batch, block_size, gen)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    rows = batch * H * splits
    ws = (torch.empty(rows * D, device="cuda"), torch.empty(rows, device="cuda"))
    out = torch.empty_like(q)
    fn = lambda: ops.paged_decode(q, k, v, bt, sl, D**-0.5, num_splits=splits, workspace=ws, out=out, config=cfg)
    fn()
    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    kv_bytes = ops.decode_kv_bytes([ctx] * batch, KVH, D, 2)
    return ms, kv_bytes / (ms * 1e-3)


def bench_prefill(lens: list[tuple[int, int]], block_size: int, cfg: ops.KernelConfig | None = None):
    """lens: (cached context, new tokens) per sequence."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [c + n for c, n in lens]
    k, v, bt = paged_cache(seq_lens, block_size, gen)
    t = sum(n for _, n in lens)
    q = torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor(
        [0] + [sum(n for _, n in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda"
    )
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    fn = lambda: ops.paged_prefill(q, k, v, qsl, sl, bt, D**-0.5, out=out, config=cfg)
    fn()
    ms = do_bench(fn, warmup=10, rep=100, return_mode="median")
    # causal FLOPs actually needed: 4 * d * heads * sum over rows of visible keys
    flops = sum(4 * D * H * (n * c + n * (n + 1) / 2) for c, n in lens)
    return ms, flops / (ms * 1e-3)


def bench_sdpa(n: int, num: int):
    q = torch.randn(num, H, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num, KVH, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    fn = lambda: f(q, k, v, is_causal=True, enable_gqa=True)
    fn()
    ms = do_bench(fn, warmup=10, rep=100, return_mode="median")
    return ms, num * 4 * D * H * n * (n + 1) / 2 / (ms * 1e-3)


def measure(name: str, f) -> tuple | None:
    """Run one measurement; a failure becomes a FAILED row instead of ending the run."""
    try:
        return f()
    except Exception as e:
        row(name, "FAILED", f"{type(e).__name__}: {str(e)[:200]}")
        return None


def kernels() -> None:
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("## decode, batch 256, ctx 1024 (K/V bytes 1.07 GB; byte ceiling at 4.3 TB/s = 250 us)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    decode_cases = [(256, None, 1)] + [
        (256, ops.KernelConfig(16, n, w, st), 1)
        for n, w, st in ((32, 4, 2), (64, 4, 2), (128, 4, 2), (64, 8, 3), (128, 8, 3))
    ]
    decode_cases += [(16, None, 1), (256, None, 2)]
    for block_size, cfg, splits in decode_cases:
        name = "default" if cfg is None else f"N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
        name = f"decode b256 c1024 bs{block_size} {name}" + (f" splits={splits}" if splits > 1 else "")
        r = measure(name, lambda: bench_decode(256, 1024, block_size, splits, cfg))
        if r is None:
            continue
        row(name, f"{r[0] * 1e3:.0f} us", f"{r[1] / 1e12:.2f} TB/s = {r[1] / HBM:.0%} of 4.3")
        if (block_size, cfg, splits) == (256, None, 1):
            ROWS.insert(
                0,
                (
                    "decode headline (b256 c1024 bs256)",
                    f"{r[1] / HBM:.0%} of HBM",
                    f"{r[0] * 1e3:.0f} us, {r[1] / 1e12:.2f} TB/s; target >= 70%",
                ),
            )
    for batch in (1, 16):
        for splits in sorted({1, ops.num_decode_splits(batch, KVH, sms)}):
            name = f"decode b{batch} c4096 splits={splits}"
            r = measure(name, lambda: bench_decode(batch, 4096, 256, splits, None))
            if r is not None:
                row(name, f"{r[0] * 1e3:.0f} us", f"{r[1] / HBM:.0%} of 4.3 TB/s")
    print("## prefill (causal FLOPs; matmul peak 790 TFLOP/s)")
    for case, lens in (
        ("8 x 1024 fresh", [(0, 1024)] * 8),
        ("2 x 4096 fresh", [(0, 4096)] * 2),
        ("4 chunks of 2048 after 2048 cached", [(2048, 2048)] * 4),
    ):
        for cfg in (
            None,
            ops.KernelConfig(64, 64, 4, 2),
            ops.KernelConfig(128, 64, 4, 3),
            ops.KernelConfig(128, 128, 8, 2),
        ):
            tag = "default" if cfg is None else f"M{cfg.block_m} N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            name = f"prefill {case} {tag}"
            r = measure(name, lambda: bench_prefill(lens, 256, cfg))
            if r is not None:
                row(name, f"{r[0] * 1e3:.0f} us", f"{r[1] / 1e12:.0f} TFLOP/s")
    for n, num in ((1024, 8), (4096, 2)):
        name = f"torch SDPA {num} x {n} causal, dense (peer)"
        r = measure(name, lambda: bench_sdpa(n, num))
        if r is not None:
            row(name, f"{r[0] * 1e3:.0f} us", f"{r[1] / 1e12:.0f} TFLOP/s")
    r = measure("store_kv 8192 tokens", bench_store)
    if r is not None:
        row("store_kv 8192 tokens", f"{r[0] * 1e3:.1f} us", f"{r[1] / 1e12:.2f} TB/s r+w")


def sampler() -> None:
    """The fused sampler at the batches of the run's phases: one program per row against the
    split rows (``num_splits``), Qwen3's 151,936-entry vocabulary in bf16, temperature 1."""
    from nanovllm.layers import fused_sampler as fs

    vocab = 151936
    print(f"## fused sampler, vocab {vocab}, bf16 logits, temperature 1 (bytes: n x {vocab * 2 / 1e6:.2f} MB)")
    for n in (1, 8, 23, 64, 104, 256):
        logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
        inv = torch.ones(n, device="cuda")
        seeds = torch.arange(n, device="cuda")
        auto = fs.num_splits(n, vocab, 4096, logits.device)
        times = {}
        for splits in sorted({1, auto}):
            name = f"sampler b{n} splits={splits}"
            r = measure(name, lambda: do_bench(lambda: fs.sample(logits, inv, seeds, splits=splits)))
            if r is not None:
                times[splits] = r
                row(name, f"{r * 1e3:.0f} us", f"{n * vocab * 2 / (r * 1e-3) / 1e12:.2f} TB/s")
        if len(times) == 2:
            row(f"sampler b{n} split / whole rows", f"{times[auto] / times[1]:.2f}x", "")


def bench_store():
    k = torch.randn(8192, KVH, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.empty(64, 256, KVH, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    slots = torch.randperm(64 * 256, device="cuda")[:8192]
    ms = do_bench(lambda: ops.store_kv(k, k, kc, vc, slots), warmup=10, rep=100, return_mode="median")
    return ms, 4 * k.numel() * 2 / (ms * 1e-3)


def engine() -> None:
    """A Qwen3-0.6B-shaped engine (random weights): decode step time, graphs vs eager."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.sampling_params import RequestOutputKind

    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": H,
        "num_key_value_heads": KVH,
        "head_dim": D,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }
    d = tempfile.mkdtemp(prefix="nanovllm-qwen3-0.6b-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    num_blocks = None  # the graph engine profiles memory; the eager one reuses its block count
    for eager in (False, True):
        t0 = time.perf_counter()
        llm = LLM(
            d,
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=4096,
            enforce_eager=eager,
            num_kvcache_blocks=num_blocks,
        )
        eng = llm.llm_engine
        num_blocks = eng.block_manager.num_blocks
        row(
            f"engine start ({'eager' if eager else 'graphs, memory profile'})",
            f"{time.perf_counter() - t0:.1f} s",
            f"{num_blocks} KV blocks of {eng.config.block_size}; "
            f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved of "
            f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}",
        )
        for i in range(256):
            eng.add_request(
                str(i),
                [(i * 7 + j) % 150000 for j in range(1024)],
                SamplingParams(
                    temperature=0.6, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
                ),
            )
        times = []
        while eng.has_unfinished_requests():
            running = eng.scheduler.running
            full_decode = (
                len(running) == 256
                and not eng.scheduler.waiting
                and all(s.num_computed_tokens + 1 == s.num_tokens for s in running)
            )
            t = time.perf_counter()
            eng.step()  # ends with the sampler's device->host copy: a synchronised step
            if full_decode:
                times.append(time.perf_counter() - t)
        runner = eng.executor.runner
        step_ms = statistics.median(times[3:]) * 1e3
        note = f"median of {len(times) - 3} steps"
        if runner.graphs is not None:
            g = runner.graphs.graphs[256]
            gpu_ms = do_bench(g.replay, warmup=5, rep=50, return_mode="median")
            note += f"; graph replay alone {gpu_ms:.2f} ms -> host/sampling {step_ms - gpu_ms:.2f} ms"
        row(f"engine decode step b256 ctx~1050 ({'eager' if eager else 'graphs'})", f"{step_ms:.2f} ms", note)
        eng.close()
        del llm, eng, runner
        torch.cuda.empty_cache()


def print_table(*_) -> None:
    print("\n| what | value | note |\n| --- | --- | --- |")
    for r in ROWS:
        print(f"| {r[0]} | {r[1]} | {r[2]} |", flush=True)


def on_timeout(*_) -> None:
    row("(stopped by SIGTERM)", "-", "figures above are complete")
    print_table()
    sys.exit(124)


def main() -> int:
    signal.signal(signal.SIGTERM, on_timeout)
    p = argparse.ArgumentParser()
    p.add_argument("--engine", action="store_true", help="also time engine decode steps (~1 min)")
    p.add_argument("--json", default=None)
    p.add_argument("--sampler-only", action="store_true", help="only the fused sampler's table (~10 s)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if not args.sampler_only:
        kernels()
    sampler()
    if args.engine:
        try:
            engine()
        except Exception as e:  # the kernel table above must still be printed
            row("engine decode step", "FAILED", f"{type(e).__name__}: {e}")
    print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
