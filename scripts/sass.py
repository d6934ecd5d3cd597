"""The decode kernels compiled offline for sm_90 (an H100/H200; no GPU needed), and what their main
loop is made of: registers, spills, shared memory, and the loop's instructions by kind (KERNEL_NOTES
sessions 20-26 counted them by hand, and once counted the wrong span: this does it one way).

    PYTHONPATH=. python3 scripts/sass.py --kernel shipped,streamk --kv fp8
    PYTHONPATH=. python3 scripts/sass.py --kernel shipped --kv bf16 --stages 3 --top 20

The compile carries the divisibility hints Triton specializes on at run time
(``tests/compile_hints.py``); without them it is not the engine's kernel. The loop is the span of
the longest *conditional* backward branch: ptxas places barrier-wait retry stubs after the kernel's
end, and their unconditional jumps back into the code are not loops.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

from tests.compile_hints import runtime_hints

KERNELS = ("shipped", "streamk")


def compile_decode(
    kernel: str = "shipped",
    kv: str = "fp8e4nv",
    block_n: int = 128,
    tma: bool = True,
    num_stages: int = 5,
    hints: bool = True,
    wide_mma: int = 0,
    model: str = "bf16",
    maxnreg: int | None = None,
    v_pairs: bool | None = None,
):
    """The decode kernel (``shipped``: ``triton_ops._decode_kernel``; ``streamk``:
    ``decode_streamk._decode_streamk_kernel``) compiled for sm_90 at Qwen3-0.6B's heads (groups of 2,
    head_dim 128), 256-slot blocks, one block-table entry per tile. ``kv`` is the cache's Triton
    type (``bf16`` or ``fp8e4nv``), ``model`` the query's. ``maxnreg`` None: as the engine launches
    it (stream-K capped by ``decode_streamk.register_cap``, the shipped kernel uncapped). ``v_pairs``
    None: as the engine reads an FP8 V (``triton_ops.FP8_V_PAIRS`` where the tiles are TMA boxes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.attention import decode_streamk, triton_ops

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    fn = triton_ops._decode_kernel if kernel == "shipped" else decode_streamk._decode_streamk_kernel
    fp8 = kv == "fp8e4nv"
    if maxnreg is None and kernel == "streamk":
        maxnreg = decode_streamk.register_cap(fp8, 1 if fp8 else 2, tma)
    signature = {p.name: "constexpr" if p.is_constexpr else "i32" for p in fn.params}
    signature.update(q_ptr=f"*{model}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", block_tables_ptr="*i32")
    signature.update(seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32", v_scale="fp32")
    if kernel == "shipped":
        signature["out_ptr"] = f"*{model}"
    else:
        signature.update(tile_map_ptr="*i64", num_tiles_ptr="*i32")
    v_asm = fp8 and model == "bf16"
    if v_pairs is None:
        v_pairs = triton_ops.FP8_V_PAIRS and tma and triton_ops.v_pairs_apply(v_asm, fp8, 128, wide_mma)
    if tma:
        signature["k_desc"] = signature["v_desc"] = f"tensordesc<{kv}[{block_n}, 128]>"
        if v_pairs:
            signature["v_desc"] = f"tensordesc<i16[{block_n}, 64]>"
    constexprs = dict(
        GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=block_n, BLOCK_SIZE=256,
        DOT_PRECISION="ieee", KV_FP8=fp8, WIDEN=model == "bf16", V_ASM=v_asm, TILE_BLOCK=True,
        TMA=tma, PDL=False, WIDE_MMA=wide_mma, V_PAIRS=v_pairs,
    )  # fmt: skip
    constexprs.update(NUM_SPLITS=1) if kernel == "shipped" else constexprs.update(NUM_KV_HEADS=8)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=runtime_hints(fn) if hints else {})
    options = {"num_warps": 4, "num_stages": num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump() -> Path:
    """Triton's own copy of NVIDIA's ``cuobjdump`` (FileNotFoundError naming the path without it)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise FileNotFoundError(f"Triton's cuobjdump is not at {tool}: cannot read a kernel's SASS")
    return tool


def _dump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(cuobjdump()), flag, str(path)], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers (``REG``), spill space (``STACK``, ``LOCAL``), static shared memory and the like."""
    out = _dump(cubin, "-res-usage")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", out.split("Function", 1)[-1])}


def sass(cubin: bytes) -> str:
    return _dump(cubin, "-sass")


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^@!?U?P\w+\s+BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def instructions(listing: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of a ``cuobjdump -sass`` listing."""
    return [(int(a, 16), text) for a, text in _INSTRUCTION.findall(listing)]


def main_loop(listing: str) -> list[str]:
    """The instructions of the longest loop: from the target of the longest conditional backward
    branch to that branch. Unconditional jumps back (the retry stubs after ``EXIT``) do not count."""
    code = instructions(listing)
    best = None
    for address, text in code:
        m = _BRANCH.match(text)
        if m and int(m.group(1), 16) < address:
            span = (int(m.group(1), 16), address)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise ValueError("no conditional backward branch: the listing has no loop")
    return [text for address, text in code if best[0] <= address <= best[1]]


def opcode(text: str) -> str:
    """``HMMA.16816.F32`` of ``@!P0 HMMA.16816.F32 R4, ...`` (the predicate dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def histogram(loop: list[str]) -> collections.Counter:
    return collections.Counter(opcode(t) for t in loop)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="shipped", help="comma-separated: shipped, streamk")
    p.add_argument("--kv", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--stages", type=int, default=None, help="default: 5 for FP8, 3 for bf16 (the shipped configs)")
    p.add_argument("--no-tma", action="store_true")
    p.add_argument("--maxnreg", type=int, default=None)
    p.add_argument(
        "--v-pairs", type=int, choices=(0, 1), default=None, help="FP8 V as int16 dim pairs (default: the engine's)"
    )
    p.add_argument("--top", type=int, default=12, help="instruction kinds listed per kernel")
    args = p.parse_args(argv)
    kv = "fp8e4nv" if args.kv == "fp8" else "bf16"
    stages = args.stages or (5 if args.kv == "fp8" else 3)
    counts = {}
    for kernel in args.kernel.split(","):
        v_pairs = None if args.v_pairs is None else bool(args.v_pairs)
        k = compile_decode(kernel, kv, args.block_n, not args.no_tma, stages, maxnreg=args.maxnreg, v_pairs=v_pairs)
        res, loop = resources(k.asm["cubin"]), main_loop(sass(k.asm["cubin"]))
        counts[kernel] = histogram(loop)
        print(
            f"{kernel} {args.kv}: {res.get('REG')} registers, stack {res.get('STACK')} B, local {res.get('LOCAL')} B, "
            f"shared {k.metadata.shared} B; main loop {len(loop)} instructions"
        )
        print("  " + ", ".join(f"{op} {n}" for op, n in counts[kernel].most_common(args.top)))
    if len(counts) == 2:
        (a, ca), (b, cb) = counts.items()
        diffs = sorted(((cb[op] - ca[op], op) for op in set(ca) | set(cb)), key=lambda d: -abs(d[0]))
        print(f"{b} - {a}: " + ", ".join(f"{op} {d:+d}" for d, op in diffs if d)[:2000])


if __name__ == "__main__":
    main()
