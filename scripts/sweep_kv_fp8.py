"""The attention kernels on an FP8 KV cache against the same kernels on bfloat16, and a sweep of
the decode kernel's tile configuration for FP8 (GPU only).

Decode at batch 256, context 1024, Qwen3-0.6B attention shape: time and achieved bandwidth on
the K/V bytes the kernel must read (half as many for FP8). Prefill of 8 x 1024 fresh tokens and
store_kv of 8192 tokens beside them. Timing: triton.testing.do_bench (median, L2 flushed).

    PYTHONPATH=. python3 scripts/sweep_kv_fp8.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from nanovllm.attention import torch_ref
from nanovllm.attention import triton_ops as ops
from scripts.bench_kernels import HBM, KVH, D, H, paged_cache

FP8 = torch.float8_e4m3fn
DECODE_CONFIGS = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 8, 2)]


def decode(batch: int, ctx: int, fp8: bool, cfg: ops.KernelConfig | None) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    k, v, bt = paged_cache([ctx] * batch, 256, gen)
    if fp8:
        k, v = k.to(FP8), v.to(FP8)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def fn():
        return ops.paged_decode(q, k, v, bt, sl, D**-0.5, out=out, config=cfg)

    fn()
    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms, ops.decode_kv_bytes([ctx] * batch, KVH, D, 1 if fp8 else 2) / (ms * 1e-3)


def prefill(fp8: bool) -> float:
    gen = torch.Generator().manual_seed(1)
    lens = [1024] * 8
    k, v, bt = paged_cache(lens, 256, gen)
    if fp8:
        k, v = k.to(FP8), v.to(FP8)
    q = torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([1024 * i for i in range(9)], dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def fn():
        return ops.paged_prefill(q, k, v, qsl, sl, bt, D**-0.5, out=out)

    fn()
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def store(fp8: bool) -> float:
    n = 8192
    kc = torch.zeros(n // 256 + 1, 256, KVH, D, device="cuda", dtype=FP8 if fp8 else torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(n, KVH, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(n, device="cuda")
    return do_bench(lambda: ops.store_kv(k, k, kc, vc, slots), warmup=10, rep=100, return_mode="median")


def main() -> None:
    print(f"{'kernel':48s} {'time':>10s} {'bandwidth':>12s}")
    ms, bw = decode(256, 1024, False, None)
    print(f"{'decode b256 c1024 bf16 (default config)':48s} {ms * 1e3:8.0f} us {bw / 1e12:8.2f} TB/s ({bw / HBM:.0%})")
    ms, bw = decode(256, 1024, True, None)
    print(f"{'decode b256 c1024 fp8 (default config)':48s} {ms * 1e3:8.0f} us {bw / 1e12:8.2f} TB/s ({bw / HBM:.0%})")
    for n, w, s in DECODE_CONFIGS:
        cfg = ops.KernelConfig(16, n, w, s)
        name = f"decode fp8 N{n} w{w} s{s}"
        try:
            ms, bw = decode(256, 1024, True, cfg)
            print(f"{name:48s} {ms * 1e3:8.0f} us {bw / 1e12:8.2f} TB/s ({bw / HBM:.0%})", flush=True)
        except Exception as e:  # a config that does not fit shared memory
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:120]}")
    for fp8 in (False, True):
        print(f"{'prefill 8 x 1024 ' + ('fp8' if fp8 else 'bf16'):48s} {prefill(fp8) * 1e3:8.0f} us")
        print(f"{'store_kv 8192 tokens ' + ('fp8' if fp8 else 'bf16'):48s} {store(fp8) * 1e3:8.1f} us")
    assert torch_ref.FP8 == FP8


if __name__ == "__main__":
    main()
