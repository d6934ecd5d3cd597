"""``scripts/sass.py``: the decode kernels' main loop read from an offline sm_90 compile.

The loop finder is checked on a listing shaped as ptxas lays kernels out (a retry stub after
``EXIT`` jumping back into the loop: taking any backward branch would count the stub's span, the
mistake session 26 made once by hand). The real compiles check what the tile's shapes fix: per tile
and thread, 64 ``HMMA.16816`` (q K^T and P V: 16 rows x 128 keys x 128 dims, twice, over 4 warps)
and 128 FP8 widenings (128 bytes of K and 128 of V per thread, two a conversion); and the stream-K
kernel's finite clamp on V at one ``HMNMX2`` per widened pair (3e50f62), where the shipped kernel,
which masks V on its peeled last tile instead, has none in its loop."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels are Triton's")

from scripts import sass  # noqa: E402

# an sm_90 SM's shared memory for CTAs: 228 KB, 1 KB of it reserved per CTA
SM_SHARED = 228 * 1024

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5 ;
        /*0040*/              @!P1 BRA 0x90 ;
        /*0050*/                   HMMA.16816.F32 R4, R8, R14, R4 ;
        /*0060*/               @P0 BRA 0x20 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5 ;
        /*00a0*/              @!P1 BRA 0x90 ;
        /*00b0*/                   BRA 0x0 ;
"""


def test_the_main_loop_is_the_longest_conditional_backward_branch():
    loop = sass.main_loop(LISTING)
    assert [sass.opcode(t) for t in loop] == [
        "HMMA.16816.F32",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT",
        "BRA",
        "HMMA.16816.F32",
        "BRA",
    ]
    assert sass.histogram(loop)["HMMA.16816.F32"] == 2
    # control: the stub's unconditional jump back is the longest backward branch of all
    jumps = [(a, int(t.split("0x")[-1], 16)) for a, t in sass.instructions(LISTING) if "BRA 0x" in t]
    assert max(jumps, key=lambda j: j[0] - j[1] if j[1] < j[0] else -1) == (0xB0, 0x0)


def test_a_listing_without_a_loop_is_refused():
    with pytest.raises(ValueError, match="no loop"):
        sass.main_loop("        /*0000*/                   EXIT ;\n")


def test_the_opcode_drops_the_predicate():
    assert sass.opcode("@!P0 HMMA.16816.F32 R4, R8, R12, R4") == "HMMA.16816.F32"
    assert sass.opcode("@UP1 UIADD3 UR4, UR5, 0x1, URZ") == "UIADD3"


@pytest.fixture(scope="module")
def cuobjdump():
    try:
        return sass.cuobjdump()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def fp8_loops(cuobjdump):
    """The FP8 loops as the engine builds them by default (V as int16 pairs, whatever
    ``NANOVLLM_FP8_V_PAIRS`` says in this process)."""
    return {
        k: sass.histogram(sass.main_loop(sass.sass(sass.compile_decode(k, v_pairs=True).asm["cubin"])))
        for k in sass.KERNELS
    }


@pytest.mark.parametrize("kernel", sass.KERNELS)
def test_one_fp8_tile_per_loop_iteration(fp8_loops, kernel):
    ops = fp8_loops[kernel]
    assert ops["HMMA.16816.F32"] == 64, ops.most_common(8)
    assert ops["F2FP.F16.E4M3.UNPACK_B"] == 128, ops.most_common(8)


def test_the_streamk_clamp_costs_one_max_per_widened_pair(fp8_loops):
    assert fp8_loops["streamk"]["HMNMX2"] == 64
    assert fp8_loops["shipped"]["HMNMX2"] == 0


def test_the_cli_compares_two_kernels(capsys, fp8_loops):
    import re

    sass.main(["--kernel", "shipped,streamk", "--kv", "fp8", "--top", "3"])
    out = capsys.readouterr().out
    regs = dict(re.findall(r"^(shipped|streamk) fp8: (\d+) registers", out, re.M))
    assert set(regs) == {"shipped", "streamk"} and all(int(n) <= 168 for n in regs.values()), out
    assert "streamk - shipped: " in out and "HMNMX2 +64" in out


@pytest.fixture(scope="module")
def fp8_byte_loops(cuobjdump):
    """The FP8 loops with V read as bytes (``V_PAIRS`` off: sessions 11-28's kernels)."""
    return {
        k: sass.histogram(sass.main_loop(sass.sass(sass.compile_decode(k, v_pairs=False).asm["cubin"])))
        for k in sass.KERNELS
    }


@pytest.mark.parametrize("kernel", sass.KERNELS)
def test_v_pairs_load_fp8_v_by_ldmatrix_not_byte_by_byte(fp8_loops, fp8_byte_loops, kernel):
    """Session 29: an FP8 V read as int16 dim pairs reaches the MMA by ``ldmatrix`` (transposed, 8
    per tile and thread) instead of 128 one-byte loads, and the loop is over a fifth shorter. The
    control: the same kernel reading bytes has the 128 ``LDS.U8``."""
    pairs, bytes_ = fp8_loops[kernel], fp8_byte_loops[kernel]
    assert pairs["LDS.U8"] == 0 and pairs["LDSM.16.MT88.4"] == 8, pairs.most_common(12)
    assert bytes_["LDS.U8"] == 128, bytes_.most_common(12)
    assert bytes_["HMMA.16816.F32"] == pairs["HMMA.16816.F32"] == 64
    assert sum(pairs.values()) < 0.8 * sum(bytes_.values()), (sum(pairs.values()), sum(bytes_.values()))


@pytest.mark.parametrize("kernel", sass.KERNELS)
def test_the_fp8_kernels_fit_three_ctas_per_sm(cuobjdump, kernel):
    """The FP8 tiles' occupancy (``decode_streamk.PROGRAMS_PER_SM``): registers and shared memory
    for 3 CTAs of 128 threads, with V read as pairs."""
    k = sass.compile_decode(kernel, v_pairs=True)
    res = sass.resources(k.asm["cubin"])
    assert res["REG"] * 128 * 3 <= 65536 and res.get("STACK", 0) == 0, res
    assert 3 * (k.metadata.shared + 1024) <= SM_SHARED, k.metadata.shared


def test_the_bf16_streamk_kernel_fits_three_ctas_per_sm(cuobjdump):
    """Stream-K on a bfloat16 cache read by masked loads (no TMA; session 28): V's rows past each end
    are zero from the load, so the kernel does not zero them in registers, which moved the tile
    through shared memory (102 KB, 2 CTAs per SM). With its register cap (``register_cap``) it fits
    3 CTAs per SM, as the shipped kernel does, and its loop stores nothing to the stack."""
    from nanovllm.attention import decode_streamk

    shipped = sass.compile_decode("shipped", "bf16", tma=False, num_stages=3)
    streamk = sass.compile_decode("streamk", "bf16", tma=False, num_stages=3)
    res = sass.resources(streamk.asm["cubin"])
    assert res["REG"] <= decode_streamk.MAXNREG and 3 * decode_streamk.MAXNREG * 128 <= 65536, res
    assert 3 * (streamk.metadata.shared + 1024) <= SM_SHARED, streamk.metadata.shared
    assert streamk.metadata.shared <= shipped.metadata.shared + 64, (streamk.metadata.shared, shipped.metadata.shared)
    loop = sass.histogram(sass.main_loop(sass.sass(streamk.asm["cubin"])))
    assert loop["STL"] == 0, loop.most_common(8)


def test_the_register_cap_follows_the_tiles():
    import torch

    from nanovllm.attention import decode_streamk, triton_ops

    def cap_of(dtype: torch.dtype, tma: bool) -> int | None:  # as paged_decode_streamk asks for a cache
        cache = torch.empty(1, 1, 1, 8, dtype=dtype)
        return decode_streamk.register_cap(triton_ops.is_fp8(cache), cache.element_size(), tma)

    cap = decode_streamk.MAXNREG
    assert cap_of(torch.bfloat16, tma=False) == cap
    assert cap_of(torch.float16, tma=False) == cap
    assert cap_of(torch.bfloat16, tma=True) is None  # V zeroed in registers
    assert cap_of(torch.float32, tma=False) is None
    if hasattr(torch, "float8_e4m3fn"):
        assert cap_of(torch.float8_e4m3fn, tma=True) == cap


@pytest.mark.parametrize("wide_mma,pairs", [(1, True), (2, False)])
def test_the_offline_compile_reads_v_as_the_engine_would(cuobjdump, monkeypatch, wide_mma, pairs):
    """``compile_decode``'s default ``v_pairs`` follows ``triton_ops.v_pairs_apply``, the engine's rule:
    WIDE_MMA's V bit keeps the byte-wise V, its K bit alone does not."""
    from nanovllm.attention import triton_ops

    monkeypatch.setattr(triton_ops, "FP8_V_PAIRS", True)
    ttgir = sass.compile_decode("shipped", wide_mma=wide_mma).asm["ttgir"]
    assert ("xi16" in ttgir) is pairs
