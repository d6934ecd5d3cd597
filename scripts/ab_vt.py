"""The FP8 decode kernel with V stored transposed per (block, head) against the shipped layout:
the same K/V values, the same batches, timed side by side (rounds alternated; the best of the
rounds' do_bench medians).

    PYTHONPATH=. python3 scripts/ab_vt.py [--rounds 3]

Prints, per batch shape, the time of each layout, the bandwidth on the FP8 bytes read, and the
largest difference between the two outputs (KERNEL_NOTES, session 20).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from nanovllm.attention import triton_ops

HEADS, KV_HEADS, D, BLOCK = 16, 8, 128, 256
SHAPES = [(256, 1024, 1024), (129, 600, 1500), (64, 1200, 2200), (32, 2048, 2048), (8, 4096, 4096)]


def case(batch: int, lo: int, hi: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    per_seq = (lens + BLOCK - 1) // BLOCK
    width = int(per_seq.max())
    num_blocks = int(per_seq.sum())
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq.tolist()):
        tables[i, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, BLOCK, KV_HEADS, D)
    strides = (KV_HEADS * BLOCK * D, D, BLOCK * D, 1)  # head-major, as the engine allocates
    k = torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="cuda")
    k.normal_()
    v.normal_()
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    k = torch.empty_strided(shape, strides, dtype=k.dtype, device="cuda").copy_(k)
    v = torch.empty_strided(shape, strides, dtype=v.dtype, device="cuda").copy_(v)
    q = torch.randn(batch, HEADS, D, dtype=torch.bfloat16, device="cuda")
    return q, k, v, tables.cuda(), lens.to(torch.int32).cuda()


def measure(batch: int, lo: int, hi: int, rounds: int, sms: int) -> str:
    q, k, v, tables, lens = case(batch, lo, hi)
    vt = triton_ops.transposed_v_cache(v)
    assert triton_ops.v_transposed(vt) and torch.equal(vt.view(torch.uint8), v.view(torch.uint8))
    splits = triton_ops.num_decode_splits(batch, KV_HEADS, sms, kv_fp8=True)  # as the engine splits FP8
    rows = batch * HEADS * splits
    ws = (torch.empty(rows * D, device="cuda"), torch.empty(rows, device="cuda"))
    outs = {}

    def run(vc: torch.Tensor, key: str) -> None:
        outs[key] = triton_ops.paged_decode(q, k, vc, tables, lens, D**-0.5, splits, ws)

    times: dict[str, list[float]] = {"shipped": [], "v_t": []}
    for _ in range(rounds):
        times["shipped"].append(do_bench(lambda: run(v, "shipped"), warmup=25, rep=200))
        times["v_t"].append(do_bench(lambda: run(vt, "v_t"), warmup=25, rep=200))
    diff = (outs["shipped"].float() - outs["v_t"].float()).abs().max().item()
    nbytes = 2 * int(lens.sum()) * KV_HEADS * D  # K and V, one byte each
    best = {key: min(t) * 1e3 for key, t in times.items()}
    return (
        f"batch {batch:3d} ctx {lo}-{hi} splits {splits}: shipped {best['shipped']:7.1f} us "
        f"({nbytes / best['shipped'] / 1e6:.2f} TB/s), V transposed {best['v_t']:7.1f} us "
        f"({nbytes / best['v_t'] / 1e6:.2f} TB/s): {best['v_t'] / best['shipped'] - 1:+.1%}; "
        f"rounds {[round(x * 1e3, 1) for x in times['shipped']]} / {[round(x * 1e3, 1) for x in times['v_t']]}; "
        f"max |diff| {diff:.2e}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}; FP8 cache, TMA boxes; us per call (the best round's do_bench median)")
    for batch, lo, hi in SHAPES:
        print(measure(batch, lo, hi, args.rounds, sms), flush=True)


if __name__ == "__main__":
    main()
