"""The decode kernel's tiles (``triton_ops.decode_config``, ``decode_tile_flags``): 128-key tiles
for 16-bit caches, 64-key ones for FP8 caches, 32 for float32 models; one block-table entry per
tile (TILE_BLOCK) exactly when no tile can straddle two cache blocks. The kernel tests under the
interpreter (tests/gpu/test_triton_kernels.py) show what a straddling tile read with TILE_BLOCK
gets wrong."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton", reason="the tile rules live in the Triton kernels' module")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanovllm.attention import triton_ops  # noqa: E402


@pytest.mark.parametrize(
    "dtype,kv_fp8,tma,keys",
    [
        (torch.bfloat16, False, False, 128),
        (torch.float16, False, False, 128),
        (torch.bfloat16, False, True, 128),
        (torch.bfloat16, True, False, 64),
        (torch.bfloat16, True, True, 128),
        (torch.float32, False, False, 32),
    ],
)
def test_keys_per_tile(dtype, kv_fp8, tma, keys):
    assert triton_ops.decode_config(128, dtype, kv_fp8, tma).block_n == keys
    if tma:  # a cache whose blocks hold whole boxes (what wants_tma asks) holds whole tiles: TILE_BLOCK
        assert triton_ops.TMA_BLOCK_N % keys == 0


def straddles(block_size: int, block_n: int) -> bool:
    """Whether some tile [k * block_n, (k + 1) * block_n) holds slots of two blocks."""
    return any((start // block_size) != ((start + block_n - 1) // block_size) for start in range(0, 4096, block_n))


@given(
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128, 256, 512]),
    block_n=st.sampled_from([16, 32, 64, 128, 256]),
    kv_fp8=st.booleans(),
)
def test_one_table_entry_per_tile_only_when_no_tile_straddles_blocks(block_size, block_n, kv_fp8):
    flags = triton_ops.decode_tile_flags(block_size, block_n, kv_fp8, torch.bfloat16)
    assert flags["TILE_BLOCK"] is not straddles(block_size, block_n)
    assert flags["V_ASM"] is kv_fp8


def test_the_straddle_check_sees_a_straddling_tile():
    """Negative control of the property's oracle: 64-key tiles over 16-slot blocks straddle."""
    assert straddles(16, 64) and not straddles(256, 128)


def _head_major(num_blocks: int, block_size: int, num_kv_heads: int, d: int) -> torch.Tensor:
    storage = torch.arange(num_blocks * num_kv_heads * block_size * d, dtype=torch.float32)
    return storage.view(num_blocks, num_kv_heads, block_size, d).transpose(1, 2)


def test_cache_rows_maps_block_head_slot_to_the_kernels_row():
    """The TMA path's row of (block, head, slot) is ``(block * kv_heads + head) * block_size + slot``
    (the kernel computes it from the cache's strides); every cell checked."""
    cache = _head_major(5, 16, 3, 8)
    rows = triton_ops.cache_rows(cache)
    assert rows is not None and rows.shape == (5 * 3 * 16, 8)
    for b in range(5):
        for h in range(3):
            for s in range(16):
                assert torch.equal(rows[(b * 3 + h) * 16 + s], cache[b, s, h])


def test_cache_rows_refuses_what_a_box_cannot_address():
    assert triton_ops.cache_rows(torch.zeros(5, 16, 3, 8)) is None  # slot-major
    assert triton_ops.cache_rows(_head_major(6, 16, 3, 8)[1:]) is not None  # a later block: still dense rows
    assert triton_ops.cache_rows(_head_major(5, 16, 3, 8)[:, :, :2]) is None  # some heads only
    assert triton_ops.cache_rows(_head_major(5, 16, 3, 8)[..., :4]) is None  # part of head_dim


def test_no_tma_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = _head_major(5, 16, 3, 8)
    assert triton_ops.tma_descriptors(cache, cache, 16) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ops.tma_descriptors(cache, cache, 16) is not None


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")
def test_v_pairs_only_where_its_tile_applies(monkeypatch):
    """``V_PAIRS`` (session 29) holds for an FP8 cache read as TMA boxes by a 16-bit model with a
    head_dim of 64 or more, and then V's descriptor views the cache as int16, two dims an element,
    K's as FP8; each missing condition turns it off and leaves V's descriptor FP8 (TMA is emulated
    on the CPU under ``TRITON_INTERPRET=1``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_ops, "FP8_V_PAIRS", True)  # the default, whatever the environment says

    def flags(kv=torch.float8_e4m3fn, d=128, model=torch.bfloat16, **overrides):
        monkeypatch.setattr(triton_ops, "DECODE_FLAG_OVERRIDES", overrides)
        cache = _head_major(4, 256, 2, d).to(kv)
        q = torch.zeros(3, 4, d, dtype=model)
        cfg = triton_ops.decode_config(d, model, triton_ops.is_fp8(cache), True)
        got, descriptors = triton_ops.decode_launch_flags(q, cache, cache, cfg, True)
        if got["V_PAIRS"]:
            assert descriptors[1].base.dtype == torch.int16 and descriptors[1].block_shape == [cfg.block_n, d // 2]
        elif descriptors is not None:
            assert descriptors[1].base.dtype == kv and descriptors[1].block_shape == [cfg.block_n, d]
        assert descriptors is None or descriptors[0].base.dtype == kv
        return got["V_PAIRS"]

    assert flags() is True
    assert flags(d=64) is True
    assert flags(model=torch.float16) is True
    assert flags(d=32) is False  # halves of 16 dims: the MMA's warps over the rows (offline: 2x the loop)
    assert flags(d=96) is False and flags(d=256) is False  # no TMA boxes: not a power of two, wider than 128
    assert flags(kv=torch.bfloat16) is False
    assert flags(kv=torch.bfloat16, V_ASM=True) is False  # an override cannot make a 16-bit cache FP8
    assert flags(model=torch.float32) is False  # no PTX widening (V_ASM) for a float32 model
    assert flags(TMA=False) is False
    assert flags(V_PAIRS=False) is False
    assert flags(WIDE_MMA=2) is False and flags(WIDE_MMA=1) is True  # the experiment's V bit keeps bytes
    monkeypatch.setattr(triton_ops, "FP8_V_PAIRS", False)  # NANOVLLM_FP8_V_PAIRS=0
    assert flags() is False


def _compile_decode_for_sm90(
    kv: str,
    block_n: int,
    tma: bool,
    num_stages: int = 3,
    hints: bool = True,
    wide_mma: int = 0,
    model: str = "bf16",
    maxnreg: int | None = None,
    v_pairs: bool | None = None,
):
    """The decode kernel compiled offline for an H200 (no GPU needed; ``scripts/sass.py``): ``kv``
    the cache's Triton type (``bf16`` or ``fp8e4nv``), one 256-slot block per table entry,
    TILE_BLOCK on. With ``hints`` the data pointers and strides carry the divisibility by 16 that
    Triton specializes on at run time (``runtime_hints``): without them the compile is not the
    kernel the engine runs (no cp.async pipelining at all; KERNEL_NOTES session 12)."""
    from scripts.sass import compile_decode

    return compile_decode("shipped", kv, block_n, tma, num_stages, hints, wide_mma, model, maxnreg, v_pairs)


@pytest.mark.parametrize("kv", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("tma", [True, False])
def test_compiled_for_sm90_tma_tiles_are_bulk_copies(kv, tma):
    """Offline compile for an H200 (no GPU), with the run time's divisibility hints: with TMA the
    decode kernel copies each K and V tile with ``cp.async.bulk.tensor`` and reads the cache with no
    per-thread copies or loads (what is left of ``ld.global`` reads the query, the lengths and the
    block table); without it, no bulk copy, and its tiles are pipelined with per-thread ``cp.async``
    (the run time's kernel: 67 of them at bf16, read out of a running engine on an H200, session 12)."""
    block_n = 64 if kv == "fp8e4nv" else 128
    ptx = _compile_decode_for_sm90(kv, block_n, tma).asm["ptx"]
    per_thread_copies = _tile_copies(ptx)
    if tma:
        assert ptx.count("cp.async.bulk.tensor") >= 2 and per_thread_copies == 0 and ptx.count("ld.global") < 32
    else:
        assert "cp.async.bulk.tensor" not in ptx and per_thread_copies >= 8, per_thread_copies


@pytest.mark.parametrize("wide_mma", [0, 1, 2, 3])
def test_compiled_for_sm90_wide_mma_gives_the_fp8_tiles_the_16_bit_operand_layout(wide_mma):
    """``WIDE_MMA`` (session 24): the widened FP8 K (bit 1) and V (bit 2) tiles pass a copy Triton
    cannot see through, so their dots take the 16-bit operand layout (``kWidth = 2``), and V
    reaches the MMA by ``ldmatrix.trans`` from shared memory. The control is the kernel without it
    (0): Triton traces the operands back to the cache's 8-bit loads, ``kWidth = 4``, and V is
    gathered byte by byte (KERNEL_NOTES sessions 4, 22 and 23). One bit alone leaves the other
    dot at ``kWidth = 4``; only V's bit removes the byte loads (a swapped bit fails here). V is
    read as bytes here (``V_PAIRS`` off), the tile this experiment was made for."""
    compiled = _compile_decode_for_sm90("fp8e4nv", 128, tma=True, num_stages=5, wide_mma=wide_mma, v_pairs=False)
    widths = set(re.findall(r"kWidth = (\d+)", compiled.asm["ttgir"]))
    byte_loads = len(re.findall(r"ld\.shared\.[ub]8", compiled.asm["ptx"]))
    assert widths == {0: {"4"}, 1: {"2", "4"}, 2: {"2", "4"}, 3: {"2"}}[wide_mma], widths
    if wide_mma & 2:
        assert byte_loads == 0, byte_loads
    else:
        assert byte_loads >= 64, byte_loads


def test_wide_mma_refuses_a_float32_models_tiles():
    """A float32 model widens FP8 tiles to float32; ``_opaque16`` copies 16-bit pairs, so it must
    refuse them at compile time, naming why, rather than return wrong bits. Control: the same
    float32 compile without WIDE_MMA succeeds."""
    import triton

    with pytest.raises(triton.CompilationError, match="16-bit"):
        _compile_decode_for_sm90("fp8e4nv", 32, tma=False, num_stages=2, wide_mma=3, model="fp32")
    assert _compile_decode_for_sm90("fp8e4nv", 32, tma=False, num_stages=2, model="fp32").asm["ptx"]


def _tile_copies(ptx: str) -> int:
    """16-byte per-thread ``cp.async`` copies (tile data; the 4-byte ones are block-table entries)."""
    return len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*0x10", ptx))


def test_offline_compiles_need_the_run_times_hints():
    """The trap session 11 fell into: compiled without the divisibility hints, the bf16 decode kernel
    has no pipelined copies at all, while with them (as at run time) its tiles are cp.async-pipelined.
    So an offline check of the code's shape must pass ``runtime_hints``."""
    assert _tile_copies(_compile_decode_for_sm90("bf16", 128, tma=False, hints=False).asm["ptx"]) == 0
    assert _tile_copies(_compile_decode_for_sm90("bf16", 128, tma=False).asm["ptx"]) >= 16


@pytest.mark.parametrize("setting", ["fp8", "all", "1", "0"])
@pytest.mark.parametrize("fp8", [True, False])
def test_which_caches_take_tma(setting, fp8, monkeypatch):
    """``DECODE_TMA``: FP8 caches by default, every 16-bit-model cache with "all"/"1", none with
    "0"; never a float32 model, blocks that do not hold whole boxes, or a slot-major cache."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take boxes only under the interpreter
    monkeypatch.setattr(triton_ops, "DECODE_TMA", setting)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = _head_major(4, 256, 2, 128).to(dtype)
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    expected = setting in ("all", "1") or (setting == "fp8" and fp8)
    assert triton_ops.wants_tma(q, cache, cache) is expected
    assert not triton_ops.wants_tma(q.float(), cache, cache)
    small = _head_major(4, 64, 2, 128).to(dtype)  # dense, but 64-slot blocks hold no whole box
    assert triton_ops.cache_rows(small) is not None and not triton_ops.wants_tma(q, small, small)
    wide = _head_major(2, 256, 1, 256).to(dtype)  # head_dim 256: wider than the kernel's tiles
    assert not triton_ops.wants_tma(q, wide, wide)
    slot_major = torch.zeros(4, 256, 2, 128, dtype=dtype)
    assert not triton_ops.wants_tma(q, slot_major, slot_major)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_ops.wants_tma(q, cache, cache)  # a CPU tensor outside the interpreter


def test_compiled_for_sm90_the_shipped_fp8_boxes_are_double_buffered():
    """The shipped FP8 TMA config (``decode_config(..., tma=True)``) compiles, for sm_90, to two
    buffers of 128x128 e4m3 per operand in shared memory (``memdesc<2x128x128xf8E4M3FN>``): the next
    box is copied while this one is used. Control: three stages give one buffer."""
    import re

    cfg = triton_ops.decode_config(128, torch.bfloat16, kv_fp8=True, tma=True)
    assert cfg.num_warps == 4  # the helper compiles with 4 warps

    def buffers(stages: int) -> set[str]:
        ir = _compile_decode_for_sm90("fp8e4nv", cfg.block_n, tma=True, num_stages=stages).asm["ttgir"]
        return set(re.findall(r"memdesc<(\d)x128x128xf8E4M3FN", ir))

    assert buffers(cfg.num_stages) == {"2"}
    assert buffers(3) == {"1"}


@pytest.mark.parametrize(
    "capability,hip,expected",
    [((9, 0), None, True), ((10, 0), None, False), ((8, 9), None, False), ((9, 4), "6.2", False)],
)
def test_tma_only_on_hopper(monkeypatch, capability, hip, expected):
    """The TMA path was measured on Hopper (9.x) only: an sm_100 or sm_120 part (other shared
    memory sizes) keeps the plain loads, an Ada part has no TMA, a ROCm GPU reporting (9, 4) is not one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    triton_ops._has_tma.cache_clear()
    try:
        assert triton_ops._has_tma(0) is expected
    finally:
        triton_ops._has_tma.cache_clear()


def test_the_kernels_refuse_a_bad_cache_pair_naming_what_is_wrong():
    """V stored otherwise than K, other shapes, other dtypes, a K whose last dim is not contiguous
    are each refused with their own message. Control: the pair as the engine makes it (both
    head-major) is taken."""
    k = _head_major(4, 256, 2, 128).to(torch.bfloat16)
    v = k.clone()
    assert k.stride() == v.stride() == triton_ops.head_major_strides(k)
    triton_ops.check_cache(k, v)
    slot_major = torch.zeros(4, 256, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="equal strides"):
        triton_ops.check_cache(slot_major, v)
    with pytest.raises(ValueError, match="need one shape"):
        triton_ops.check_cache(k, v[:2])
    with pytest.raises(ValueError, match="need one dtype"):
        triton_ops.check_cache(k, v.to(torch.float16))
    with pytest.raises(ValueError, match="contiguous last dim"):
        triton_ops.check_cache(k.transpose(2, 3), k.transpose(2, 3))


def _resources(cubin: bytes, tmp_path) -> dict[str, int]:
    """Registers, local memory (spills) and the like of a compiled kernel, read by cuobjdump."""
    from scripts import sass

    try:
        sass.cuobjdump()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return sass.resources(cubin)


@pytest.mark.parametrize("stages", [3, 5])
def test_maxnreg_caps_the_fp8_decode_kernels_registers_without_spills(stages, tmp_path):
    """``KernelConfig.maxnreg`` (session 25's occupancy A/B): the FP8 TMA kernel compiles to more
    than 128 registers per thread (168-184 by variant: at most 3 CTAs of 128 threads per SM); capped
    at 128 (4 CTAs where shared memory allows: at 3 stages) ptxas keeps everything in registers (no
    local memory). The control is the compile without the cap, which must be over 128, or the cap
    would test nothing."""
    free = _resources(_compile_decode_for_sm90("fp8e4nv", 128, tma=True, num_stages=stages).asm["cubin"], tmp_path)
    capped = _compile_decode_for_sm90("fp8e4nv", 128, tma=True, num_stages=stages, maxnreg=128)
    got = _resources(capped.asm["cubin"], tmp_path)
    assert free["REG"] > 128, free
    assert got["REG"] <= 128 and got["LOCAL"] == 0 and got["STACK"] == 0, got
