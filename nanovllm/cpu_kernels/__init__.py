"""The CPU path's compiled kernels, for float32: paged attention reading the cache in place (decode
rows and prefill rows alike), the cache writes (``store_kv``), the elementwise work (RoPE, RMSNorm,
SiLU times up, greedy rows) and the linear layers (``rows_linear``, batch-invariant).

PyTorch operators cannot read a block table in place, so the plain-PyTorch decode path copies
every block a sequence uses (``index_select``) before two batched products over tiny matrices, and
its prefill path gathers each sequence's context and multiplies the full square of scores before
masking half of it. ``paged_attention.c`` walks each query row's slots through its block table
instead, reading each key and value once per row and kv head, causal rows seeing only their own
prefix.

It is plain C (no PyTorch headers: the four files compile in 2-3 s) built with the machine's C
compiler on first use into the on-disk cache (``$NANOVLLM_CACHE/kernels``, keyed by the source,
the compiler and this CPU's flags: ``-march=native``), and called through ctypes, which releases
the GIL. Its OpenMP is torch's own ``libgomp`` (the same soname, already loaded by torch), so its
threads are torch's threads. Where there is no C compiler, the build fails or
``NANOVLLM_CPU_KERNELS=0`` (A/B measurements, the oracle's tests), the PyTorch path runs, and a
log line says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanovllm.loader.cache import build_once, cache_root

logger = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [
    HERE / "paged_attention.c",
    HERE / "elementwise.c",
    HERE / "rows_linear.c",
    HERE / "rows_quant.c",
    HERE / "decode_layers.c",
]
HEADERS = [HERE / "vec_exp.h", HERE / "cpu_kernels.h", HERE / "rows_frame.h"]
LIBRARY = "cpu_kernels.so"
SWITCH = "NANOVLLM_CPU_KERNELS"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


SANITIZE = "NANOVLLM_CPU_KERNELS_SANITIZE"
SANITIZERS = {"address", "undefined"}  # what NANOVLLM_CPU_KERNELS_SANITIZE may name, comma-separated


def sanitize_refusal() -> str | None:
    """Why NANOVLLM_CPU_KERNELS_SANITIZE's value cannot be built or loaded here, or None. A library
    built with AddressSanitizer needs its runtime loaded before Python (LD_PRELOAD): loaded later,
    the runtime ends the process instead of failing the load."""
    value = os.environ.get(SANITIZE, "")
    if not value:
        return None
    names = value.split(",")
    if not set(names) <= SANITIZERS:
        return f"{SANITIZE}={value!r}: a comma-separated list of {', '.join(sorted(SANITIZERS))}"
    if "address" in names:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        if "libasan" not in maps:
            return f"{SANITIZE}={value!r} needs the AddressSanitizer runtime preloaded (LD_PRELOAD=libasan.so)"
    return None


def compile_flags() -> list[str]:
    # -std=c11: no fused multiply-add contraction, so the sums are the ones written (FMA measured within
    # noise); -fno-math-errno: expf without the errno path (1.2-1.4x on the whole kernel)
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    sanitize = os.environ.get(SANITIZE, "")
    if sanitize:  # e.g. "address,undefined" (tests/test_cpu_kernels_sanitized.py): every report aborts
        flags += [f"-fsanitize={sanitize}", f"-fno-sanitize-recover={sanitize}", "-fno-omit-frame-pointer", "-g"]
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(cc: str) -> str:
    """What the built library depends on: the source, the compiler's version, the flags, this CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [
        *(f.read_bytes() for f in SOURCES + HEADERS),
        version.encode(),
        " ".join(compile_flags()).encode(),
        _cpu_flags().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def _build(cc: str, out_dir: Path) -> None:
    cmd = [cc, *compile_flags(), *map(str, SOURCES), "-o", str(out_dir / LIBRARY), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")


class Kernels(NamedTuple):
    paged_attention: Any
    store_kv: Any
    rotary_neox: Any
    greedy: Any
    rms_norm: Any
    silu_and_mul: Any
    rows_linear: Any  # None where the build has neither AVX-512 nor AVX2 with FMA (rows_linear.c)
    rows_pack: Any
    rows_reference: Any  # the same order in scalar code, for the tests (rows_linear.c)
    rows_chunk_max_rows: int  # the most rows rows_linear takes K in chunks for (more: whole segments per tile)
    rows_linear_quant: Any  # the same product over weights kept in a GGUF block format (rows_quant.c)
    rows_pack_quant: Any
    decode_layers: Any  # a decode step's decoder layers in one call (decode_layers.c, decode_layers.py)


@cache
def load() -> Kernels | None:
    """The ctypes functions, or None where the kernel cannot be used (the reason is logged once)."""
    if os.environ.get(SWITCH, "1") == "0":
        logger.info("%s=0: CPU attention runs in PyTorch", SWITCH)
        return None
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler (cc, gcc or $CC): CPU attention runs in PyTorch (slower)")
        return None
    refused = sanitize_refusal()
    if refused:
        logger.warning("the CPU kernels are not built: %s; PyTorch and oneDNN run their work", refused)
        return None
    try:
        dest = cache_root() / "kernels" / f"cpu_kernels-{build_key(cc)}"
        library = ctypes.CDLL(str(Path(build_once(dest, LIBRARY, lambda tmp: _build(cc, tmp))) / LIBRARY))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU kernels could not be built or loaded (%s): PyTorch and oneDNN run their work", e)
        return None
    attention = library.paged_attention_f32
    attention.restype = ctypes.c_int
    attention.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    attention.argtypes += [ctypes.c_int64]
    store = library.store_kv_f32
    store.restype = ctypes.c_int
    store.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_int64]
    rope = library.rotary_neox_f32
    rope.restype = ctypes.c_int
    rope.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    greedy = library.greedy_f32
    greedy.restype = None
    greedy.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_int64, ctypes.c_int]
    norm = library.rms_norm_f32
    norm.restype = ctypes.c_int
    norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 2
    norm.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    silu = library.silu_and_mul_f32
    silu.restype = ctypes.c_int
    silu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
    library.set_sleef_exp.restype = None
    library.set_sleef_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.set_sleef_exp(*_sleef_exp())
    rows_linear = library.rows_linear_f32
    rows_linear.restype = ctypes.c_int
    rows_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    rows_pack = library.rows_pack_f32
    rows_pack.restype = None
    rows_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    reference = library.rows_linear_reference_f32
    reference.restype = None
    reference.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    vectorized = bool(library.rows_linear_vectorized())
    rows_quant = library.rows_linear_quant
    rows_quant.restype = ctypes.c_int
    pointers, ints, strides = [ctypes.c_void_p] * 2, [ctypes.c_int] * 3, [ctypes.c_int64] * 2
    rows_quant.argtypes = [*pointers, ctypes.c_int, *pointers, *ints, *strides, ctypes.c_int, ctypes.c_int]
    pack_quant = library.rows_pack_quant
    pack_quant.restype = ctypes.c_int
    pack_quant.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    return Kernels(
        attention,
        store,
        rope,
        greedy,
        norm,
        silu,
        rows_linear if vectorized else None,
        rows_pack if vectorized else None,
        reference,
        library.rows_linear_chunk_max_rows(),
        rows_quant if vectorized else None,
        pack_quant,
        _decode_layers(library),
    )


def _decode_layers(library: ctypes.CDLL):
    from nanovllm.cpu_kernels.decode_layers import bind

    return bind(library)


def _sleef_exp() -> tuple[int | None, int | None]:
    """The addresses of torch's own vector e^x (Sleef, 8 and 16 lanes) in libtorch_cpu, or None."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None, None
    found = [getattr(lib, name, None) for name in ("Sleef_expf8_u10", "Sleef_expf16_u10")]
    return tuple(None if f is None else ctypes.cast(f, ctypes.c_void_p).value for f in found)  # type: ignore[return-value]


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def applies(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernels' case: float32 tensors and cache on the CPU, the kernels built (other dtypes,
    or no compiler, take the PyTorch path)."""
    return _float32_cpu(x, k_cache) and load() is not None


def _kernels(*tensors: torch.Tensor) -> Kernels:
    """The loaded kernels for these tensors; they read raw float32 memory, so anything else is refused."""
    kernels = load()
    if kernels is None:
        raise RuntimeError("the CPU kernels are not available (see the log for why)")
    if not _float32_cpu(*tensors):
        raise ValueError(f"the CPU kernels take float32 CPU tensors, got {[(t.dtype, t.device.type) for t in tensors]}")
    return kernels


def _rows(x: torch.Tensor) -> bool:
    """[T, heads, d] with each row's heads contiguous (a row stride of its own is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``torch_ref.store_kv(..., head_major=True)`` for float32: each token's K/V into its slot."""
    kernels = _kernels(key, value, k_cache, v_cache)
    key = key if _rows(key) else key.contiguous()
    value = value if _rows(value) else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[1] != num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"store_kv: key {tuple(key.shape)} does not fit cache {tuple(k_cache.shape)}")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[2]
    status = kernels.store_kv(
        key.data_ptr(),
        value.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_dim,
        k_cache.shape[2],
        key.stride(0),
        value.stride(0),
        torch.get_num_threads(),
        num_slots,
    )
    if status != 0:  # checked before any write: the cache is as it was
        raise slot_error("store_kv", slots, num_slots)


# The kernels' refusals as exceptions, one wording for their wrappers here and for the fused decode
# layers (models/cpu_decode.py), which name the layer in ``where``.
def slot_error(where: str, slots: torch.Tensor, num_slots: int) -> IndexError:
    return IndexError(f"{where}: slot_mapping has slot {int(slots.max())} outside the KV cache's {num_slots} slots")


def position_error(where: str, positions: torch.Tensor, table_rows: int) -> IndexError:
    return IndexError(f"{where}: a position ({int(positions.max())}) lies outside the {table_rows}-row tables")


def attention_error(
    where: str, status: int, lens: torch.Tensor, tables: torch.Tensor, block_size: int, num_blocks: int
) -> Exception:
    if status == -2:  # checked before any read
        return IndexError(
            f"{where}: a seq_len ({lens.tolist()}) exceeds its block table ({tables.shape[1]} blocks of "
            f"{block_size}), a row reaches past its sequence, or a block id used lies outside the cache's "
            f"{num_blocks} blocks"
        )
    return MemoryError(f"{where}: the kernel could not allocate its scratch memory")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, d] (one row per sequence); caches head-major [num_blocks, num_kv_heads,
    block_size, d]; block_tables [num_seqs, width] and seq_lens [num_seqs], int32 -> [num_seqs, num_heads, d]."""
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def prefill_rows(query_start_loc: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For a step's query rows: the sequence each belongs to and how many slots it sees (row j of
    a sequence's n new rows sits at position seq_len - n + j: causal, bottom-right aligned)."""
    row_seq: list[int] = []
    row_len: list[int] = []
    for i, seq_len in enumerate(seq_lens):
        n = query_start_loc[i + 1] - query_start_loc[i]
        row_seq += [i] * n
        row_len += range(seq_len - n + 1, seq_len + 1)
    return torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``torch_ref.paged_attention(..., head_major=True)`` for float32. q: [num_rows, num_heads, d];
    caches head-major [num_blocks, num_kv_heads, block_size, d]; block_tables [num_seqs, width] and
    seq_lens [num_seqs], int32; ``rows`` = (sequence of each row, slots it sees), int32
    (``prefill_rows``); None: one row per sequence seeing all its slots (decode)."""
    kernels = _kernels(q, k_cache, v_cache)
    num_rows, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    q = q if _rows(q) else q.contiguous()  # a view of the qkv projection is read in place
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if rows is None:
        row_seq, row_len = None, lens
    else:
        row_seq, row_len = (t.to(torch.int32).contiguous() for t in rows)
    if row_len.numel() != num_rows or (row_seq is not None and row_seq.numel() != num_rows):
        raise ValueError(f"paged_attention: {num_rows} query rows, {row_len.numel()} row lengths")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the caches must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype)
    status = kernels.paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        None if row_seq is None else row_seq.data_ptr(),
        row_len.data_ptr(),
        out.data_ptr(),
        lens.numel(),
        num_rows,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        torch.get_num_threads(),
        k_cache.shape[0],
        q.stride(0),
    )
    if status != 0:
        raise attention_error("paged_attention", status, lens, tables, block_size, k_cache.shape[0])
    return out


def elementwise_applies(*tensors: torch.Tensor) -> bool:
    """The elementwise kernels' case: float32 CPU tensors whose last dimension is contiguous, the
    kernels built."""
    return _float32_cpu(*tensors) and all(t.stride(-1) == 1 for t in tensors) and load() is not None


def rotary_neox_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotary embedding in place on q [T, heads, d] and k [T, kv_heads, d] (rows of their own
    stride, heads contiguous), with the cos / sin tables [max_position, d] (the first d / 2 used)."""
    kernels = _kernels(q, k, cos, sin)
    tokens, heads, head_dim = q.shape
    if not (_rows(q) and _rows(k)) or k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rotary_neox_: q {tuple(q.shape)} / k {tuple(k.shape)} are not rows of whole heads")
    if cos.shape != sin.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.shape[-1] < head_dim // 2:
        raise ValueError(
            f"rotary_neox_: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} tables do not fit head_dim {head_dim}"
        )
    pos = positions.to(torch.int64).contiguous()
    status = kernels.rotary_neox(
        q.data_ptr(),
        k.data_ptr(),
        pos.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        k.shape[1],
        head_dim // 2,
        q.stride(0),
        k.stride(0),
        cos.stride(0),
        cos.shape[0],
        torch.get_num_threads(),
    )
    if status != 0:  # checked before any write
        raise position_error("rotary_neox_", pos, cos.shape[0])


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [rows, vocab] -> (argmax per row (the first maximum, as torch.argmax), whether
    every logit of the row is finite), in one C call instead of five full-vocabulary operators."""
    kernels = _kernels(logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        logits = logits.reshape(logits.shape[0], -1).contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.bool)
    if rows and vocab:
        kernels.greedy(
            logits.data_ptr(),
            tokens.data_ptr(),
            finite.data_ptr(),
            rows,
            vocab,
            logits.stride(0),
            torch.get_num_threads(),
        )
    else:
        tokens.zero_(), finite.fill_(True)
    return tokens, finite


ROWS_STRIP = 16  # output columns per strip of a rows-packed weight (rows_linear.c)


def rows_linear_available() -> bool:
    """Whether the rows linear kernel is built (float32; AVX-512, or AVX2 with FMA) and not switched off."""
    kernels = load()
    return kernels is not None and kernels.rows_linear is not None


def rows_chunk_max_rows() -> int:
    """The most rows ``rows_linear`` multiplies K chunk by K chunk (decode steps: 7 rows and more, all
    row tiles through a chunk of weights before the next); more rows take whole segments per row tile.
    The two paths sum in the same order; the packing check probes both."""
    return _kernels().rows_chunk_max_rows


def rows_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] packed for ``rows_linear``: strips of 16 output columns,
    [ceil(N / 16), K, 16], zero columns past N."""
    kernels = _kernels(weight)
    if kernels.rows_pack is None:
        raise RuntimeError(
            "rows_pack: this build of the CPU kernels has neither AVX-512 nor AVX2 (rows_linear_available() is False)"
        )
    if weight.dim() != 2:
        raise ValueError(f"rows_pack: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    out = torch.empty(-(-n // ROWS_STRIP), k, ROWS_STRIP, dtype=torch.float32)
    kernels.rows_pack(weight.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


ROWS_BLOCK = 32  # weights of one output row per block of a quantized weight (rows_quant.c)
# the GGUF block formats rows_quant.c keeps weights in: name -> (its number there, bytes of one strip's block)
ROWS_FORMATS = {"q4_1": (1, 384), "q8_0": (2, 576)}


def rows_format(strips: torch.Tensor) -> str:
    """The form of a rows-packed weight: "f32" (``rows_pack``), or the block format ``rows_pack_quant``
    kept it in, told by its block's bytes."""
    if strips.dtype == torch.float32:
        return "f32"
    for name, (_, size) in ROWS_FORMATS.items():
        if strips.dtype == torch.uint8 and strips.dim() == 3 and strips.shape[2] == size:
            return name
    raise ValueError(
        f"rows-packed strips of dtype {strips.dtype} and shape {tuple(strips.shape)} are neither rows_pack's "
        f"float32 nor rows_pack_quant's uint8 blocks of {', '.join(f'{v[1]} bytes ({k})' for k, v in ROWS_FORMATS.items())}"
    )


def rows_pack_quant(weight: torch.Tensor, format: str) -> torch.Tensor | None:
    """A float32 weight [N, K] kept for ``rows_linear`` in a GGUF block format (``ROWS_FORMATS``): uint8
    [ceil(N / 16), K / 32, block bytes], where every block of 32 weights of a row has that format's
    exact form (d, m and q whose dequantization gives the block back bitwise), else None. A weight
    read from a GGUF file in that format has one; a float32 checkpoint's weights almost never do.
    ``rows_linear`` then gives the float32 product's bits from a third (Q8_0) or a fifth (Q4_1) of the bytes."""
    if format not in ROWS_FORMATS:
        raise ValueError(f"rows_pack_quant: format must be one of {sorted(ROWS_FORMATS)}, got {format!r}")
    kernels = _kernels(weight)
    if weight.dim() != 2:
        raise ValueError(f"rows_pack_quant: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if n == 0 or k == 0 or k % ROWS_BLOCK:
        return None
    number, size = ROWS_FORMATS[format]
    weight = weight.detach().contiguous()
    out = torch.empty(-(-n // ROWS_STRIP), k // ROWS_BLOCK, size, dtype=torch.uint8)
    missed = kernels.rows_pack_quant(weight.data_ptr(), out.data_ptr(), number, n, k, torch.get_num_threads())
    if missed < 0:
        raise ValueError(f"rows_pack_quant: the kernel refused N={n}, K={k}, format {format!r}")
    return out if missed == 0 else None


def _check_strips(strips: torch.Tensor, n: int, k: int, x_shape: tuple) -> int:
    """The C side's number for the strips' form (0: float32), once their shape is checked against N and K."""
    form = rows_format(strips)
    if strips.device.type != "cpu":
        raise ValueError(f"rows_linear: packed strips must be on the CPU, got {strips.device}")
    if form == "f32":
        want, made_by = (-(-n // ROWS_STRIP), k, ROWS_STRIP), "rows_pack's"
    else:
        want, made_by = (-(-n // ROWS_STRIP), k // ROWS_BLOCK, ROWS_FORMATS[form][1]), f"rows_pack_quant's {form}"
    if form != "f32" and k % ROWS_BLOCK:
        raise ValueError(f"rows_linear: x has K={k}, not a multiple of {ROWS_BLOCK}: no {form} weight has it")
    if tuple(strips.shape) != want or not strips.is_contiguous():
        raise ValueError(
            f"rows_linear: packed strips {tuple(strips.shape)} (contiguous: {strips.is_contiguous()}) are not "
            f"{made_by} {want} for N={n} and x {x_shape}"
        )
    return 0 if form == "f32" else ROWS_FORMATS[form][0]


def rows_linear(x: torch.Tensor, strips: torch.Tensor, n: int, bias: torch.Tensor | None, segment: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, n] with W packed by ``rows_pack`` (float32) or ``rows_pack_quant``
    (a block format; the same bits as float32) into ``strips``: each output a fused multiply-add chain
    over K, restarted every ``segment`` elements, the segments added in order, then the bias
    (rows_linear.c, rows_quant.c)."""
    kernels = _kernels(x, *([] if bias is None else [bias]))
    if kernels.rows_linear is None:
        raise RuntimeError(
            "rows_linear: this build of the CPU kernels has neither AVX-512 nor AVX2 (rows_linear_available() is False)"
        )
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    m, k = x.shape
    # the kernel reads rows x.stride(0) floats apart, each row's K floats in order: other layouts are copied
    # (a broadcast row has stride 0; a one-row view may have any row stride, so it is read as contiguous)
    if m > 1 and (x.stride(1) != 1 or x.stride(0) < k):
        x = x.contiguous()
    elif m == 1 and x.stride(1) != 1:
        x = x.contiguous()
    row_stride = x.stride(0) if m > 1 else k
    form = _check_strips(strips, n, k, tuple(x.shape))
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(
            f"rows_linear: bias must be {n} contiguous floats (N={n}), got {bias.numel()} "
            f"(contiguous: {bias.is_contiguous()})"
        )
    if form and segment < k and segment % ROWS_BLOCK:
        raise ValueError(f"rows_linear: a quantized weight's segment must be K or a multiple of 32, got {segment}")
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    bias_ptr = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if form:
        status = kernels.rows_linear_quant(
            x.data_ptr(), strips.data_ptr(), form, bias_ptr, out.data_ptr(), m, n, k, row_stride, n, segment, threads
        )
    else:
        status = kernels.rows_linear(
            x.data_ptr(), strips.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, row_stride, n, segment, threads
        )
    if status == -2:
        raise MemoryError(f"rows_linear: no memory for a thread's dequantized strips (K={k})")
    if status != 0:
        raise ValueError(
            f"rows_linear: the kernel refused x {tuple(x.shape)} (row stride {row_stride}), N={n}, segment={segment} "
            f"(segment must be >= 1)"
        )
    return out


def rows_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segment: int
) -> torch.Tensor:
    """``rows_linear``'s product in scalar C, in the same order, from the plain weight [N, K]: the tests'
    oracle for the vector kernel (slow: tests only)."""
    kernels = _kernels(x, weight, *([] if bias is None else [bias]))
    x, weight = x.contiguous(), weight.detach().contiguous()
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or segment < 1 or (bias is not None and bias.numel() != n):
        raise ValueError(f"rows_linear_reference: x {tuple(x.shape)}, weight {tuple(weight.shape)}, segment={segment}")
    out = torch.empty(m, n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    kernels.rows_reference(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, k, n, segment)
    return out


# (rows, n) probes for the RMSNorm lane check: a decode row, scalar tails, the cascade's levels
_NORM_PROBES = ((3, 16), (5, 17), (7, 576), (2, 600), (3, 1000), (2, 4096), (2, 16384))


def _rms_norm_call(kernels: Kernels, x, weight, eps, residual, lanes: int):
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    summed = torch.empty(rows, n, dtype=torch.float32) if residual is not None else None
    status = kernels.rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        weight.data_ptr(),
        rows,
        n,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
        lanes,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"rms_norm: lanes {lanes} outside 1..16")
    return out if residual is None else (out, summed)


@cache
def rms_norm_lanes() -> int | None:
    """The vector width (8 or 16 floats) in whose order this torch sums a float32 row, found by
    comparing the C RMSNorm with ``F.rms_norm`` bitwise on probe rows (with and without a residual);
    None, and PyTorch keeps RMSNorm, where neither width gives torch's result everywhere."""
    import torch.nn.functional as F

    kernels = load()
    if kernels is None:
        return None
    g = torch.Generator().manual_seed(0)
    for lanes in (8, 16):
        same = True
        for rows, n in _NORM_PROBES:
            x, r, w = (torch.randn(rows, n, generator=g, dtype=torch.float32) * 3 for _ in range(3))
            w = w[0].contiguous()
            out, summed = _rms_norm_call(kernels, x, w, 1e-6, r, lanes)
            same &= torch.equal(summed, x + r) and torch.equal(out, F.rms_norm(x + r, (n,), w, 1e-6))
        if same:
            return lanes
    logger.info("the C RMSNorm does not add in this torch's order: RMSNorm stays in PyTorch")
    return None


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """float32 CPU rows (a 2-d tensor, its last dimension contiguous; the residual likewise) and a
    C RMSNorm that adds in torch's order (``rms_norm_lanes``)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not _float32_cpu(*tensors) or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return False
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        return False
    return weight.shape == (x.shape[1],) and load() is not None and rms_norm_lanes() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``F.rms_norm(x, weight, eps)``, or with a residual ``(F.rms_norm(x + residual), x + residual)``,
    bitwise, in one pass per row (``rms_norm_applies`` says where)."""
    lanes = rms_norm_lanes()
    if lanes is None:
        raise RuntimeError("the C RMSNorm is not available (see the log for why)")
    return _rms_norm_call(_kernels(x, weight), x, weight, eps, residual, lanes)


GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: below it torch runs an elementwise operator on one thread
# (rows, n) probes for the SiLU check: a decode batch, scalar tails (600 and 48: a tail of 8 lanes'
# blocks of 16, inside 16 lanes' blocks of 32: the probe that tells the widths apart on one thread),
# pieces cut mid-row, a larger tile
_SILU_PROBES = ((1, 1536), (32, 1536), (31, 1536), (4, 100), (3, 600), (2, 48), (3, 11008), (41, 1000), (160, 1536))


def _torch_pieces(numel: int) -> int:
    """How many pieces torch's parallel_for cuts an elementwise operator over numel floats into."""
    threads = torch.get_num_threads()
    if numel < GRAIN_SIZE or threads == 1:
        return 1
    return min(threads, -(-numel // GRAIN_SIZE))


def _silu_call(kernels: Kernels, x: torch.Tensor, lanes: int) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    pieces = _torch_pieces(rows * n)
    status = kernels.silu_and_mul(
        x.data_ptr(), x[:, n:].data_ptr(), out.data_ptr(), rows, n, x.stride(0), x.stride(0), lanes, pieces, pieces
    )
    if status != 0:
        raise ValueError(f"silu_and_mul: no vector e^x of {lanes} lanes here")
    return out


@cache
def silu_lanes() -> int | None:
    """The vector width (8 or 16 floats) of torch's SiLU kernel, found by comparing the C SiLU-and-
    multiply with ``F.silu(gate).mul_(up)`` bitwise on probe shapes; None, and PyTorch keeps SiLU,
    where neither width (or torch's e^x) gives torch's result everywhere."""
    import torch.nn.functional as F

    kernels = load()
    if kernels is None:
        return None
    g = torch.Generator().manual_seed(0)
    probes = [torch.randn(rows, 2 * n, generator=g, dtype=torch.float32) * 4 for rows, n in _SILU_PROBES]
    for lanes in (8, 16):
        try:
            if all(
                torch.equal(_silu_call(kernels, x, lanes), F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1])
                for x in probes
            ):
                return lanes
        except ValueError:
            continue
    logger.info("the C SiLU does not compute as this torch does: SiLU stays in PyTorch")
    return None


def silu_applies(x: torch.Tensor) -> bool:
    """[rows, 2n] float32 CPU (the merged [gate | up] projection, its last dimension contiguous) and
    a C SiLU that computes as torch does (``silu_lanes``)."""
    return (
        _float32_cpu(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
        and load() is not None and silu_lanes() is not None
    )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for x = [gate | up] ([rows, 2n] -> [rows, n]), bitwise, in one pass."""
    lanes = silu_lanes()
    if lanes is None:
        raise RuntimeError("the C SiLU is not available (see the log for why)")
    return _silu_call(_kernels(x), x, lanes)
