"""Session 8's engine A/B: run ``nanovllm bench`` (arguments after the variant) with the new
kernels on or with the old behaviour restored in this process (KERNEL_NOTES session 8).

    PYTHONPATH=. python3 scripts/ab_engine.py {old,new}[,OPTION=VALUE...] bench --workload gpu ...

old:      qk_norm_rope one head per program, the prefill kernel without SPLIT_MASK/TILE_BLOCK at
          its old tile config, mixed steps' decode rows in the prefill kernel (before session 8);
          it keeps later sessions' changes (PDL, 128-key decode tiles): add pdl=0,tile=64x4x3,tb=0
          for the kernels as they were before session 10;
new:      everything as shipped (the mixed-step split on since session 9; split=0 or
          NANOVLLM_MIXED_DECODE_SPLIT=0 turns it off).
waves=N:  decode split-K aimed at N programs per SM (``triton_ops.DECODE_SPLIT_WAVES``, session 9);
fp8waves=N: the same for FP8 caches (``triton_ops.FP8_DECODE_SPLIT_WAVES``, session 21).
mbt=N:    N tokens per step by default on CUDA (``config.DEFAULT_MAX_NUM_BATCHED_TOKENS``, session 9).
layout=head|slot: the Triton cache's storage (``triton_backend.HEAD_MAJOR_CACHE``, session 9).
split=0|1: a mixed step's leading decode rows to the decode kernel (``triton_backend.MIN_SPLIT_DECODES``).
blas=lt|default: torch's cuBLAS front end for the linear layers (``torch.backends.cuda.preferred_blas_library``, session 10).
tile=NxWxS[xR]: the decode kernel's keys per tile, warps and stages for 16-bit caches (session 10),
          and at most R registers per thread (``maxnreg``, session 25).
fp8tile=NxWxS[xR]: the same for FP8 caches (session 10).
tb=0|1:   TILE_BLOCK (one block-table entry per key tile) forced off/on in the decode kernel (session 10).
tma=0|1|fp8: the decode kernel's K/V tiles copied by TMA for no cache, every 16-bit-model cache, or
          FP8 caches only (the default; ``NANOVLLM_DECODE_TMA``, session 11).
pdl=0|1:  programmatic dependent launch of the Triton kernels (``NANOVLLM_PDL``, session 10; on by default).
gemm=0|1: the smallest decode batches' (1-4 rows) linear layers in Triton with PDL (``NANOVLLM_DECODE_GEMM``,
          session 12; on by default); gemmrows=N: the most rows it takes (``decode_gemm.MAX_ROWS``);
          gemmcfg=BIG/SMALLxBKxWxS: its config (column strips for N >= 4096 / below, K step,
          warps, stages), as ``ab_kernels.py --only gemm`` names them.
pre=N:    the preloading linear kernel (weights loaded before the PDL wait) for up to N rows
          (``decode_gemm.PRELOAD_MAX_ROWS``, session 16; 0 by default); precfg=BIG/SMALLxBMxW: its config;
          early=0|1: RMSNorm and SiLU-and-mul let their successor launch before they wait
          (``fused_ops.EARLY_RELEASE``), so the preloading kernel overlaps two kernels.
kvstore=0|1: Qwen3's fused q/k norm + RoPE kernel also writes K/V into the cache (1, the default since
          session 13) or leaves it to the store kernel (``NANOVLLM_FUSED_KV_STORE``).
sampler=PATH: the fused sampler's module loaded from PATH (another version of
          ``nanovllm/layers/fused_sampler.py``, e.g. ``git show REV:nanovllm/layers/fused_sampler.py``)
          in place of the shipped one (session 15).
wide=0..3: the widened FP8 K (1), V (2) or both (3) reach the MMA as 16-bit operands (``WIDE_MMA``
          in the decode kernel, through ``DECODE_FLAG_OVERRIDES``; session 24: with fp8tile=128x4x3
          -6 % on an H100; at the shipped 128x4x5, 2 CTAs per SM, not measured yet).
streamk=0|fp8|1: decode attention by the stream-K kernel for no cache, FP8 caches or every cache
          (``triton_backend.DECODE_STREAMK``, ``NANOVLLM_DECODE_STREAMK``; session 25; fp8 by default
          since session 26).
skbatches=LO:HI: the decode batches the stream-K kernel takes (``triton_backend.STREAMK_BATCHES``,
          ``NANOVLLM_DECODE_STREAMK_BATCHES``; session 26, 16:128 by default).
vpairs=0|1: an FP8 V read as TMA boxes of int16 dim pairs, two PV products a tile (1, the default since
          session 29: ``V_PAIRS``, ``NANOVLLM_FP8_V_PAIRS``) or as bytes (0, sessions 11-28).
rowwarm=0|1: start-up runs the LM head and the sampler on every row count 1..max_num_seqs, and
          the runner's pending-row scatter once (``NANOVLLM_ROW_WARMUP``, read by
          ``nanovllm.worker.sampling_warmup.enabled``, sessions 22-23; on by default).
"""

from __future__ import annotations

import os
import sys


def _set(module: str, name: str, convert):
    def apply(value: str) -> None:
        import importlib

        setattr(importlib.import_module(module), name, convert(value))

    return apply


def _set_mbt(value: str) -> None:
    from nanovllm import config

    config.DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"] = int(value)


def _set_blas(value: str) -> None:
    os.environ["TORCH_BLAS_PREFER_CUBLASLT"] = "1" if value == "lt" else "0"  # processes started later
    import torch

    torch.backends.cuda.preferred_blas_library("cublaslt" if value == "lt" else "cublas")


def _tile_setter(fp8: bool):
    """``tile=`` (16-bit caches) or ``fp8tile=`` (FP8 caches): the decode kernel's tiles of 16-bit
    models for that cache type; float32 models keep theirs."""

    def apply(value: str) -> None:
        from nanovllm.attention import triton_ops

        n, w, st, *reg = map(int, value.split("x"))
        shipped = triton_ops.decode_config

        def decode_config(d, dtype, kv_fp8=False, tma=False):
            cfg = shipped(d, dtype, kv_fp8, tma)
            mine = triton_ops.KernelConfig(16, n, w, st, reg[0] if reg else None)
            return mine if kv_fp8 == fp8 and cfg.block_n != 32 else cfg

        triton_ops.decode_config = decode_config

    return apply


def _set_flag(name: str, convert):
    """An option that forces one of the decode kernel's flags (``DECODE_FLAG_OVERRIDES``)."""

    def apply(value: str) -> None:
        from nanovllm.attention import triton_ops

        triton_ops.DECODE_FLAG_OVERRIDES[name] = convert(value)

    return apply


def _set_tma(value: str) -> None:
    os.environ["NANOVLLM_DECODE_TMA"] = value  # processes started later
    _set("nanovllm.attention.triton_ops", "DECODE_TMA", str)(value)


def _set_gemm_config(value: str) -> None:
    from nanovllm.layers import decode_gemm

    decode_gemm.default_config = decode_gemm.parse_config(value)  # applies() reads it too: K falls back


def _parses(parser: str, module: str = "nanovllm.layers.decode_gemm"):
    """A validator: ``<module>.<parser>(value)`` does not raise ValueError."""

    def valid(value: str) -> bool:
        import importlib

        try:
            getattr(importlib.import_module(module), parser)(value)
        except ValueError:
            return False
        return True

    return valid


def _set_preload_config(value: str) -> None:
    from nanovllm.layers import decode_gemm

    decode_gemm.preload_config = decode_gemm.parse_preload_config(value)


def _is_tile(value: str) -> bool:
    parts = value.split("x")  # NxWxS, or NxWxSxR with R the registers per thread (maxnreg)
    return len(parts) in (3, 4) and all(_positive(p) for p in parts)


def _positive(value: str) -> bool:
    return value.isdigit() and int(value) > 0


def _parse_batches(value: str) -> tuple[int, int]:
    from nanovllm.attention.triton_backend import _parse_batches

    return _parse_batches(value)


def _set_sampler(path: str) -> None:
    """Load PATH as ``nanovllm.layers.fused_sampler`` before the engine's lazy import asks for it."""
    import importlib.util

    name = "nanovllm.layers.fused_sampler"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


# option -> (apply, is the value accepted)
SETTINGS = {
    "waves": (_set("nanovllm.attention.triton_ops", "DECODE_SPLIT_WAVES", int), _positive),
    "fp8waves": (_set("nanovllm.attention.triton_ops", "FP8_DECODE_SPLIT_WAVES", int), _positive),
    "mbt": (_set_mbt, _positive),
    "layout": (
        _set("nanovllm.attention.triton_backend", "HEAD_MAJOR_CACHE", lambda v: v == "head"),
        lambda v: v in ("head", "slot"),
    ),
    "blas": (_set_blas, lambda v: v in ("lt", "default")),
    "tile": (_tile_setter(fp8=False), _is_tile),
    "fp8tile": (_tile_setter(fp8=True), _is_tile),
    "tb": (_set_flag("TILE_BLOCK", lambda v: v == "1"), lambda v: v in ("0", "1")),
    "streamk": (_set("nanovllm.attention.triton_backend", "DECODE_STREAMK", str), lambda v: v in ("0", "fp8", "1")),
    "skbatches": (
        _set("nanovllm.attention.triton_backend", "STREAMK_BATCHES", _parse_batches),
        _parses("_parse_batches", "nanovllm.attention.triton_backend"),
    ),
    "tma": (_set_tma, lambda v: v in ("0", "1", "fp8")),
    "pdl": (lambda v: os.environ.__setitem__("NANOVLLM_PDL", v), lambda v: v in ("0", "1")),
    "gemm": (lambda v: os.environ.__setitem__("NANOVLLM_DECODE_GEMM", v), lambda v: v in ("0", "1")),
    "gemmrows": (_set("nanovllm.layers.decode_gemm", "MAX_ROWS", int), _positive),
    "gemmcfg": (_set_gemm_config, _parses("parse_config")),
    "pre": (_set("nanovllm.layers.decode_gemm", "PRELOAD_MAX_ROWS", int), str.isdigit),
    "precfg": (_set_preload_config, _parses("parse_preload_config")),
    "early": (_set("nanovllm.layers.fused_ops", "EARLY_RELEASE", lambda v: v == "1"), lambda v: v in ("0", "1")),
    "kvstore": (lambda v: os.environ.__setitem__("NANOVLLM_FUSED_KV_STORE", v), lambda v: v in ("0", "1")),
    "sampler": (_set_sampler, os.path.isfile),
    "wide": (_set_flag("WIDE_MMA", int), lambda v: v in ("0", "1", "2", "3")),
    "vpairs": (_set_flag("V_PAIRS", lambda v: v == "1"), lambda v: v in ("0", "1")),
    "rowwarm": (lambda v: os.environ.__setitem__("NANOVLLM_ROW_WARMUP", v), lambda v: v in ("0", "1")),
    "split": (
        _set("nanovllm.attention.triton_backend", "MIN_SPLIT_DECODES", lambda v: 8 if v == "1" else None),
        lambda v: v in ("0", "1"),
    ),
}


def main() -> int:
    variant, *options = sys.argv[1].split(",")
    argv = sys.argv[2:]
    if variant not in ("old", "new"):
        raise SystemExit(f"variant must be old or new, got {variant!r}")
    for option in options:
        key, _, value = option.partition("=")
        if key not in SETTINGS or not SETTINGS[key][1](value):
            raise SystemExit(f"option must be one of {', '.join(SETTINGS)} with its values, got {option!r}")
        SETTINGS[key][0](value)
    if variant == "old":
        from nanovllm.attention import triton_backend, triton_ops
        from nanovllm.layers import fused_ops

        fused_ops.QK_HEADS_PER_PROGRAM = 1
        triton_ops.PREFILL_FLAG_OVERRIDES.update(SPLIT_MASK=False, TILE_BLOCK=False)
        new_config = triton_ops.prefill_config
        triton_ops.prefill_config = lambda d, dtype: (
            triton_ops.KernelConfig(128, 64, 8, 2) if new_config(d, dtype).block_n == 64 else new_config(d, dtype)
        )
        triton_backend.MIN_SPLIT_DECODES = None
    from nanovllm.entrypoints.cli import main as cli

    print(f"# variant {sys.argv[1]}", flush=True)
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
