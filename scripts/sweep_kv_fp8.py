"""The attention kernels on an FP8 KV cache against the same kernels on bfloat16, and a sweep of
the decode kernel's tile configuration and tile flags for FP8 (GPU only).

Decode at batch 256, context 1024, Qwen3-0.6B attention shape: time and achieved bandwidth on
the K/V bytes the kernel must read (half as many for FP8). Each decode variant's output is
compared with the session-3 kernel's (N128 w4 s3, both tile flags off) on the same inputs: the largest
absolute difference is printed beside its time. Prefill of 8 x 1024 fresh tokens and store_kv
of 8192 tokens beside them. Timing: triton.testing.do_bench (median, L2 flushed).

    PYTHONPATH=. python3 scripts/sweep_kv_fp8.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.testing import do_bench

from nanovllm.attention import torch_ref
from nanovllm.attention import triton_ops as ops
from scripts.bench_kernels import HBM, KVH, D, H, paged_cache

FP8 = torch.float8_e4m3fn
OFF = dict(TILE_BLOCK=False, V_ASM=False)  # the session-3 kernel
# (label, config (N, warps, stages) or None for the default, flag overrides, splits)
FP8_VARIANTS: list[tuple[str, tuple[int, int, int] | None, dict, int]] = [
    ("session 3 (flags off) N128 w4 s3", (128, 4, 3), OFF, 1),
    ("flags off N64 w4 s3", (64, 4, 3), OFF, 1),
    ("tile block only N128 w4 s3", (128, 4, 3), {**OFF, "TILE_BLOCK": True}, 1),
    ("V asm only N128 w4 s3", (128, 4, 3), {**OFF, "V_ASM": True}, 1),
    ("both flags N128 w4 s3", (128, 4, 3), {}, 1),
    ("default (both flags, N64 w4 s3)", None, {}, 1),
    ("both flags N64 w4 s4", (64, 4, 4), {}, 1),
    ("both flags N64 w2 s3", (64, 2, 3), {}, 1),
    ("both flags N32 w4 s3", (32, 4, 3), {}, 1),
    ("default, 2 splits", None, {}, 2),
]
REPEATS = 3  # the main comparisons alternate A B A B A B (noise between runs of one kernel: ~2 %)


class Decode:
    """One decode problem (batch x ctx, block size 256) on a bf16 or FP8 cache."""

    def __init__(self, batch: int, ctx: int, fp8: bool):
        gen = torch.Generator().manual_seed(0)
        self.k, self.v, self.bt = paged_cache([ctx] * batch, 256, gen)
        if fp8:
            self.k, self.v = self.k.to(FP8), self.v.to(FP8)
        self.q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        self.sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.bytes = ops.decode_kv_bytes([ctx] * batch, KVH, D, 1 if fp8 else 2)
        rows = batch * H * ops.MAX_SPLITS
        self.ws = (torch.empty(rows * D, device="cuda"), torch.empty(rows, device="cuda"))

    def fn(self, cfg: ops.KernelConfig | None, splits: int) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(self.q)
        return lambda: ops.paged_decode(
            self.q, self.k, self.v, self.bt, self.sl, D**-0.5, num_splits=splits, workspace=self.ws, out=out, config=cfg
        )

    def time(self, cfg: ops.KernelConfig | None, flags: dict, splits: int = 1) -> tuple[float, float, torch.Tensor]:
        ops.DECODE_FLAG_OVERRIDES.clear()
        ops.DECODE_FLAG_OVERRIDES.update(flags)
        try:
            fn = self.fn(cfg, splits)
            result = fn().clone()
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        finally:
            ops.DECODE_FLAG_OVERRIDES.clear()
        return ms, self.bytes / (ms * 1e-3), result


def line(name: str, ms: float, bw: float, diff: float | None = None) -> None:
    extra = "" if diff is None else f"  max |diff| vs session 3: {diff:.2e}"
    print(f"{name:52s} {ms * 1e3:8.0f} us {bw / 1e12:8.2f} TB/s ({bw / HBM:4.0%}){extra}", flush=True)


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
    print(f"{'kernel':52s} {'time':>11s} {'bandwidth':>15s}")
    bf = Decode(256, 1024, False)
    _, _, ref = bf.time(None, OFF)
    for i in range(REPEATS):
        ms, bw, _ = bf.time(None, {})
        line(f"decode b256 c1024 bf16, default (flags off) #{i + 1}", ms, bw)
        ms, bw, out = bf.time(None, {"TILE_BLOCK": True})
        diff = (out.float() - ref.float()).abs().max().item()
        line(f"decode b256 c1024 bf16, tile block forced #{i + 1}", ms, bw, diff)
    del bf
    f8 = Decode(256, 1024, True)
    s3 = ops.KernelConfig(16, 128, 4, 3)
    _, _, base = f8.time(s3, OFF)
    for i in range(REPEATS):
        for name, cfg, flags in [("session 3 (flags off) N128 w4 s3", s3, OFF), ("default", None, {})]:
            ms, bw, out = f8.time(cfg, flags)
            line(f"decode fp8 {name} #{i + 1}", ms, bw, (out.float() - base.float()).abs().max().item())
    for name, shape, flags, splits in FP8_VARIANTS:
        cfg = None if shape is None else ops.KernelConfig(16, *shape)
        try:
            ms, bw, out = f8.time(cfg, flags, splits)
        except Exception as e:  # a config that does not fit shared memory
            print(f"decode fp8 {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        line(f"decode fp8 {name}", ms, bw, (out.float() - base.float()).abs().max().item())
    del f8
    for batch, ctx in [(32, 2048), (8, 4096)]:  # the shrinking tail: few sequences, auto split
        for fp8 in (False, True):
            dec = Decode(batch, ctx, fp8)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            splits = ops.num_decode_splits(batch, KVH, sms, kv_fp8=fp8)
            ms, bw, _ = dec.time(None, {}, splits)
            line(f"decode b{batch} c{ctx} {'fp8' if fp8 else 'bf16'} default, {splits} splits", ms, bw)
            del dec
    for fp8 in (False, True):
        print(f"{'prefill 8 x 1024 ' + ('fp8' if fp8 else 'bf16'):52s} {prefill(fp8) * 1e3:8.0f} us")
        print(f"{'store_kv 8192 tokens ' + ('fp8' if fp8 else 'bf16'):52s} {store(fp8) * 1e3:8.1f} us")
    assert torch_ref.FP8 == FP8


if __name__ == "__main__":
    main()
