"""The rows linear kernel (``cpu_kernels/rows_linear.c``): batch-invariant float32 products.

It replaces oneDNN's packed product for float32 weights wherever it is built and its vector code
keeps its order for the weight's shape (``cpu_linear._kernel_keeps_its_order``, at packing). Two
questions, tested apart:

- Does the vector kernel sum in its documented order? Against the scalar reference of that order
  (``rows_linear_reference``), bitwise, on any machine; and so does the packing check decide.
- Is that order this machine's oneDNN's? On the development machine (AMD EPYC, AVX-512, torch
  2.13.0+cpu) it is, for every shape measured (``DEV_RULE``), so there the kernel and oneDNN give the
  same bits. Where a machine's oneDNN sums a shape otherwise (decided by comparing oneDNN with the
  scalar reference under DEV_RULE: neither the kernel nor ``cpu_linear.segment`` takes part), the
  tests that compare with oneDNN skip, naming it; the engine still uses the kernel there.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nanovllm import cpu_kernels
from nanovllm.layers import cpu_linear
from tests.rows_checks import assert_equals_reference

pytestmark = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_kernels.rows_linear_available()),
    reason="the rows kernel is off here (it needs the CPU kernels built, with AVX-512 or AVX2, and NANOVLLM_CPU_KERNELS "
    "not 0) or oneDNN is missing to compare with",
)

# (N, K): SmolLM2-135M's four layer products and its LM head's K, Qwen3-0.6B's MLP, and shapes with a
# last strip of 1-15 columns and segments that do not divide K
# (AVX2 splits a strip in two 8-column vectors: a last strip of 9-15 columns masks both, N = 45)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (1024, 3072), (17, 1100), (100, 700), (33, 64), (45, 130))
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 10, 11, 13, 32, 37, 48, 49, 300)  # every last row tile, 1 to 6 rows


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _onednn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed product, a lone row as a pair (what ``cpu_linear.linear`` gives on that path)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT)
    return cpu_linear.onednn_product(x, packed, bias, pair=x.shape[0] == 1)


def _rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_linear.linear(x, w, bias, cpu_linear.RowsWeight(w))


def DEV_RULE(k: int) -> int:
    """oneDNN's segment on the development machine, as measured (kept here apart from
    ``cpu_linear.segment``, so that a change there is checked against the measurement)."""
    return k if k <= 512 else 512 if k <= 1024 else 1024


def onednn_follows_the_rule(n: int, k: int, bias: bool = False) -> bool:
    """Whether this machine's oneDNN sums an N x K weight (2 and 37 random rows, a lone row as a pair)
    in DEV_RULE's order: compared with the scalar reference, not with the kernel."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(37, k, generator=g)
    return all(
        torch.equal(cpu_kernels.rows_linear_reference(x[:m], w, b, DEV_RULE(k)), _onednn(x[:m], w, b))
        for m in (1, 2, 37)
    )


def require_onednns_order(n: int, k: int, bias: bool = False) -> None:
    if not onednn_follows_the_rule(n, k, bias):
        pytest.skip(
            f"this machine's oneDNN sums N={n}, K={k} (bias={bias}) in another order than the development "
            "machine's: the rows kernel's bits (its own order, checked against the scalar reference) are "
            "not oneDNN's here, so there are no oneDNN bits to match"
        )


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", (False, True))
def test_the_vector_kernel_sums_in_its_documented_order(n, k, bias):
    """Any machine: the vector kernel (AVX-512 or AVX2) equals the scalar reference of its order bitwise, every row count."""
    w = _weight(n, k, seed=n + k)
    b = torch.randn(n) if bias else None
    x = torch.randn(max(ROW_COUNTS), k, generator=torch.Generator().manual_seed(k))
    seg = cpu_linear.segment(k)
    differ = [
        m
        for m in ROW_COUNTS
        if not torch.equal(_rows(x[:m], w, b), cpu_kernels.rows_linear_reference(x[:m], w, b, seg))
    ]
    assert not differ, f"N={n} K={k}: the vector kernel differs from the scalar reference at {differ} rows"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", (False, True))
def test_the_rows_kernel_gives_onednns_bits(n, k, bias):
    require_onednns_order(n, k, bias)
    assert cpu_linear.segment(k) == DEV_RULE(k), f"K={k}: segment() left oneDNN's measured order"
    w = _weight(n, k, seed=n + k)
    b = torch.randn(n) if bias else None
    x = torch.randn(max(ROW_COUNTS), k, generator=torch.Generator().manual_seed(k))
    differ = [m for m in ROW_COUNTS if not torch.equal(_rows(x[:m], w, b), _onednn(x[:m], w, b))]
    assert not differ, f"N={n} K={k}: the rows kernel differs from oneDNN at {differ} rows"


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", (False, True))
def test_the_packing_check_passes_the_kernel_as_built(n, k, bias):
    """Any machine: the packing check finds the vector code in its order for every shape (else the
    engine would fall back to oneDNN and lose the kernel's speed and batch invariance)."""
    w = _weight(n, k, seed=n + k)
    assert cpu_linear._kernel_keeps_its_order(w, torch.randn(n) if bias else None)


@pytest.mark.parametrize(
    "bug",
    [
        "lone row in 512-element pieces",
        "bias dropped",
        "last strip's columns zeroed",
        "7th row of a tile skipped",
        "chunked rows restart their sums at every K chunk",
        "rows past the chunked path summed as one chain",
    ],
)
def test_the_packing_check_sees_a_kernel_that_leaves_its_order(monkeypatch, bug):
    """Negative controls of ``_kernel_keeps_its_order``: each way the vector code could go wrong is
    seen on a weight of N = 100 (a partial last strip) and K = 1,536 (two segments), with a bias."""
    rows_linear = cpu_kernels.rows_linear

    def broken(x, strips, n, bias, segment):
        m, chunked_max = x.shape[0], cpu_kernels.rows_chunk_max_rows()
        if bug == "lone row in 512-element pieces" and m == 1:
            segment = 512
        if bug == "chunked rows restart their sums at every K chunk" and 6 < m <= chunked_max:
            segment = min(segment, 24)
        if bug == "rows past the chunked path summed as one chain" and m > chunked_max:
            segment = x.shape[1]
        y = rows_linear(x, strips, n, None if bug == "bias dropped" else bias, segment)
        if bug == "last strip's columns zeroed":
            y[:, n - n % 16 :] = 0
        if bug == "7th row of a tile skipped" and x.shape[0] >= 7:
            y[6] = 0
        return y

    w, b = _weight(100, 1536, seed=9), torch.randn(100)
    assert cpu_linear._kernel_keeps_its_order(w, b)
    monkeypatch.setattr(cpu_kernels, "rows_linear", broken)
    assert not cpu_linear._kernel_keeps_its_order(w, b), f"the packing check missed: {bug}"


def test_the_packing_check_probes_a_wide_weights_last_partial_strip(monkeypatch):
    """An LM head's N (49,152 + 3 here) is probed on its first 256 columns and the same remainder
    modulo 64: a bug in the last partial strip (3 columns) is seen without multiplying all of N."""
    rows_linear = cpu_kernels.rows_linear

    def tail_zeroed(x, strips, n, bias, segment):
        y = rows_linear(x, strips, n, bias, segment)
        if n % 16:
            y[:, n - n % 16 :] = 0
        return y

    w = _weight(49155, 64, seed=10)
    assert cpu_linear._probe_columns(49155) == 256 + 49155 % 64
    assert cpu_linear._kernel_keeps_its_order(w, None)
    monkeypatch.setattr(cpu_kernels, "rows_linear", tail_zeroed)
    assert not cpu_linear._kernel_keeps_its_order(w, None)


@pytest.mark.parametrize("n", [1000, 49200])
def test_the_packing_check_probes_the_last_partial_tile_of_several_strips(monkeypatch, n):
    """The probe keeps the weight's remainder modulo a tile's 64 columns, not modulo a strip's 16: for
    N = 1,000 (40 = 2 whole strips and a partial one) and 49,200 (48: three whole strips, no partial
    strip at all), a fault only in a last tile of more than one strip is seen."""
    rows_linear = cpu_kernels.rows_linear

    def last_tile_zeroed(x, strips, n, bias, segment):
        y = rows_linear(x, strips, n, bias, segment)
        if n % 64 > 16:
            y[:, n - n % 64 :] = 0
        return y

    assert n % 64 > 16 and n % 64 != n % 16  # a rule modulo 16 would probe another last tile
    w = _weight(n, 64, seed=11)
    assert cpu_linear._probe_columns(n) == 256 + n % 64
    assert cpu_linear._kernel_keeps_its_order(w, None)
    monkeypatch.setattr(cpu_kernels, "rows_linear", last_tile_zeroed)
    assert not cpu_linear._kernel_keeps_its_order(w, None)


@pytest.mark.parametrize("n,k", SHAPES[:4])
def test_a_row_is_the_same_alone_in_any_batch_and_at_any_thread_count(n, k):
    w = _weight(n, k, seed=1)
    rows = cpu_linear.RowsWeight(w)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_linear.linear(x, w, None, rows)
        torch.set_num_threads(2)
        for m in (1, 2, 3, 7, 31, 64):
            got = cpu_linear.linear(x[:m], w, None, rows)
            assert torch.equal(got, one_thread[:m]), f"{m} rows on 2 threads differ from the rows on 1"
        alone = torch.cat([cpu_linear.linear(x[r : r + 1], w, None, rows) for r in range(8)])
        assert torch.equal(alone, one_thread[:8])
    finally:
        torch.set_num_threads(threads)


def test_rows_with_a_stride_of_their_own_are_read_in_place():
    """A view of wider rows (a slice of a fused projection's output) gives the contiguous rows' bits."""
    w = _weight(96, 576, seed=3)
    wide = torch.randn(9, 700)
    x = wide[:, 50:626]
    assert x.stride(0) == 700 and not x.is_contiguous()
    assert torch.equal(_rows(x, w, None), _rows(x.contiguous(), w, None))


def test_the_rows_kernel_is_close_to_a_float64_product():
    """Not only equal to oneDNN: right (guards a shared mistake in both, such as a dropped column)."""
    w = _weight(100, 1100, seed=4)
    b = torch.randn(100)
    x = torch.randn(11, 1100)
    want = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(_rows(x, w, b), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["broadcast", "one-row view", "column view"])
def test_rows_in_any_layout_give_the_contiguous_rows_bits(layout):
    """Rows whose stride is below K (a broadcast row: stride 0; a one-row view of a transposed
    column), or whose K floats are not adjacent, are read as their contiguous copy would be."""
    w = _weight(96, 576, seed=8)
    row = torch.randn(1, 576)
    x = {
        "broadcast": row.expand(3, -1),
        "one-row view": row.t().contiguous().t(),  # (1, 576) with strides (1, 1)
        "column view": torch.randn(576, 4)[:, 1:2].t(),  # (1, 576) with K floats 4 apart
    }[layout]
    assert torch.equal(_rows(x, w, None), _rows(x.contiguous(), w, None))
    assert torch.equal(_rows(x, w, None), cpu_kernels.rows_linear_reference(x, w, None, cpu_linear.segment(576)))


def test_no_rows_give_an_empty_product():
    w = _weight(40, 64, seed=5)
    assert _rows(torch.empty(0, 64), w, None).shape == (0, 40)


def test_bad_shapes_are_refused_with_the_shapes_named():
    w = _weight(40, 64, seed=6)
    rows = cpu_linear.RowsWeight(w)
    with pytest.raises(ValueError, match=r"packed strips \(3, 64, 16\) .* are not rows_pack.s \(3, 65, 16\)"):
        cpu_kernels.rows_linear(torch.randn(3, 65), rows.strips, 40, None, 64)
    with pytest.raises(ValueError, match=r"bias must be 40 contiguous floats \(N=40\), got 39"):
        cpu_kernels.rows_linear(torch.randn(3, 64), rows.strips, 40, torch.randn(39), 64)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.rows_linear(torch.randn(3, 64, dtype=torch.float64), rows.strips, 40, None, 64)
    with pytest.raises(ValueError, match="segment=0"):
        cpu_kernels.rows_linear(torch.randn(3, 64), rows.strips, 40, None, 0)


def test_the_segment_rule_is_what_decides_the_bits():
    """Negative controls: each other segment length than the rule's gives other bits than oneDNN for a
    K past the first restart (so the comparison above could fail)."""
    for n, k in ((576, 576), (576, 1536), (100, 3072)):
        require_onednns_order(n, k)
        w = _weight(n, k, seed=7)
        x = torch.randn(7, k)
        want = _onednn(x, w, None)
        strips = cpu_kernels.rows_pack(w)
        for other in {k, 256, 512, 1024} - {DEV_RULE(k)}:
            got = cpu_kernels.rows_linear(x, strips, n, None, other)
            assert not torch.equal(got, want), f"K={k}: segment {other} gave oneDNN's bits as well"


def test_a_shape_where_the_kernel_leaves_its_order_keeps_onednn(monkeypatch, caplog):
    """Where the vector code does not give its scalar reference's bits for a shape (a compiler or CPU
    that breaks it), those weights keep oneDNN's packed copy, a warning names the shape, and the
    others still get the kernel."""
    from nanovllm.layers.linear import ColumnParallelLinear

    model = torch.nn.Sequential(ColumnParallelLinear(1536, 64), ColumnParallelLinear(64, 1536))
    for layer in model:
        layer.weight.data.normal_()
    rows_linear = cpu_kernels.rows_linear

    def one_chain(x, strips, n, bias, segment):  # not its order for K > 512
        return rows_linear(x, strips, n, bias, x.shape[1])

    monkeypatch.setattr(cpu_kernels, "rows_linear", one_chain)
    with caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        assert cpu_linear.pack_linear_weights(model) == 2
    assert not isinstance(model[0].packed_weight, cpu_linear.RowsWeight)
    assert isinstance(model[0].packed_weight, torch.Tensor)
    assert isinstance(model[1].packed_weight, cpu_linear.RowsWeight)
    assert "N=64, K=1536, bias=False" in caplog.text


def test_float32_weights_get_the_kernel_and_the_switch_turns_it_off(monkeypatch):
    """Any machine where the kernel is built: a float32 layer packs for it, gives its reference's bits,
    and ``NANOVLLM_CPU_ROWS_LINEAR=0`` gives it oneDNN's packed copy instead (equal bits where this
    machine's oneDNN follows the measured order: ``test_the_rows_kernel_gives_onednns_bits``)."""
    from nanovllm.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(576, 96)
    layer.weight.data.normal_()
    x = torch.randn(5, 576)
    cpu_linear.pack_linear_weights(layer)
    assert isinstance(layer.packed_weight, cpu_linear.RowsWeight)
    with_kernel = layer(x)
    assert torch.equal(with_kernel, cpu_kernels.rows_linear_reference(x, layer.weight, None, cpu_linear.segment(576)))
    monkeypatch.setenv(cpu_linear.ROWS_SWITCH, "0")
    cpu_linear.pack_linear_weights(layer)
    assert isinstance(layer.packed_weight, torch.Tensor)
    # two float32 summation orders of K products differ by at most K * eps * sum |x_k w_k| (each output)
    bound = 576 * torch.finfo(torch.float32).eps * (x.abs() @ layer.weight.detach().abs().T)
    assert ((layer(x) - with_kernel).abs() <= bound).all(), "oneDNN and the kernel differ beyond float32 rounding"
    assert not ((layer(x)[:, 1:] - with_kernel[:, :-1]).abs() <= bound[:, 1:]).all()  # control: columns shifted


def test_the_order_check_sees_another_order(monkeypatch):
    """Negative control of ``onednn_follows_the_rule``, the gate of the oneDNN comparisons: one chain
    over K = 1,536 (another order than oneDNN's here) is seen as another order."""
    import sys

    require_onednns_order(576, 1536)
    monkeypatch.setattr(sys.modules[__name__], "DEV_RULE", lambda k: k)
    assert not onednn_follows_the_rule(576, 1536)


def test_the_packing_verdict_is_asked_per_bias(monkeypatch):
    """Two layers of one shape, the first without a bias and the second with one, and a kernel that
    drops the bias: the biased layer must be asked on its own and keep oneDNN, while the other keeps
    the kernel. A verdict keyed by the shape alone would hand the biased layer the broken kernel.
    Control: that one-line bug (the key without the bias) is shown to give the wrong packing."""
    from nanovllm.layers.linear import ColumnParallelLinear

    def model():
        m = torch.nn.Sequential(ColumnParallelLinear(64, 48), ColumnParallelLinear(64, 48, bias=True))
        for layer in m:
            layer.weight.data.normal_()
        m[1].bias.data.normal_()
        return m

    rows_linear = cpu_kernels.rows_linear
    monkeypatch.setattr(
        cpu_kernels, "rows_linear", lambda x, strips, n, bias, seg: rows_linear(x, strips, n, None, seg)
    )
    m = model()
    cpu_linear.pack_linear_weights(m)
    assert isinstance(m[0].packed_weight, cpu_linear.RowsWeight)
    assert not isinstance(m[1].packed_weight, cpu_linear.RowsWeight), "the biased layer took the bias-dropping kernel"

    check = cpu_linear._kernel_keeps_its_order
    asked: dict = {}

    def by_shape_only(weight, bias, form="f32"):  # the bug: one verdict per shape, whatever the bias
        return asked.setdefault(tuple(weight.shape), check(weight, bias, form))

    monkeypatch.setattr(cpu_linear, "_kernel_keeps_its_order", by_shape_only)
    m = model()
    cpu_linear.pack_linear_weights(m)
    assert isinstance(m[1].packed_weight, cpu_linear.RowsWeight), "the control shows nothing"


def test_the_avx2_code_keeps_the_order_where_the_engine_builds_avx512(tmp_path):
    """The engine's build takes the AVX-512 code where the CPU has it, so on such a machine the AVX2
    code (most laptops) would go unchecked: it is built here apart (``-mno-avx512f``) and compared
    with the scalar reference bitwise, at the row counts of each tile shape it picks (1 x 3 strips, 2 x 2,
    6 x 1, K chunks) and partial last strips. Control: the AVX2 code run in another segment order
    fails the same comparison."""
    import ctypes
    import subprocess

    cc = cpu_kernels.compiler()
    flags = cpu_kernels._cpu_flags().split()
    if cc is None or not {"avx2", "fma"} <= set(flags):
        pytest.skip("no C compiler, or this CPU has no AVX2 with FMA to run the AVX2 code on")
    lib_path = tmp_path / "rows_avx2.so"
    source = cpu_kernels.HERE / "rows_linear.c"
    subprocess.run(
        [cc, *cpu_kernels.compile_flags(), "-mno-avx512f", str(source), "-o", str(lib_path), "-lm"], check=True
    )
    lib = ctypes.CDLL(str(lib_path))
    assert lib.rows_linear_vectorized() == 1, "the build apart did not take the AVX2 code"
    run = lib.rows_linear_f32
    run.restype = ctypes.c_int
    run.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.rows_pack_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3

    def call(x, strips, bias, m, n, k, seg, threads):
        bias_ptr = None if bias is None else bias.data_ptr()
        return lambda y, ldy: run(x.data_ptr(), strips.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, x.stride(0), ldy,
                                  seg, threads)  # fmt: skip

    for n, k in ((17, 1100), (100, 700), (960, 576), (40, 24), (45, 130)):  # last strips of 1, 4, 16, 8, 13
        w = _weight(n, k, seed=n * k)
        b = torch.randn(n)
        strips = torch.empty(-(-n // 16), k, 16)
        lib.rows_pack_f32(w.data_ptr(), strips.data_ptr(), n, k, 2)
        x = torch.randn(60, k + 3, generator=torch.Generator().manual_seed(k))[:, :k]  # rows k + 3 floats apart
        seg = cpu_linear.segment(k)
        for m in (1, 2, 3, 4, 5, 6, 7, 10, 11, 13, 48, 49, 60):
            for bias, threads in ((None, 2), (b, 1), (b, 7)):
                where = f"AVX2 N={n} K={k} rows={m} bias={bias is not None} threads={threads}"
                assert_equals_reference(call(x, strips, bias, m, n, k, seg, threads), x, w, bias, m, seg, where)
    # control: the AVX2 code run in another order (8-element segments) and the same comparison fails
    y = torch.empty(2, n)
    assert run(x.data_ptr(), strips.data_ptr(), None, y.data_ptr(), 2, n, k, x.stride(0), n, 8, 2) == 0
    assert not torch.equal(y, cpu_kernels.rows_linear_reference(x[:2].contiguous(), w, None, seg))
