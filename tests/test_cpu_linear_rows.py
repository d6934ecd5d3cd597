"""A row's product does not depend on the rows beside it on the CPU (bitwise), for every K: float32, and
bfloat16 where this CPU's oneDNN runs it natively.

oneDNN's packed linear sums one row alone in another order than the same row among others where
K > 1,024 (torch 2.13.0+cpu on the AVX-512 development machine: 512-element K blocks each summed
from zero, against blocks chained in pairs): a batch-1 decode step of SmolLM2-135M (its down
projection has K = 1,536) gave other last bits than the same sequence in a batch (57 of 64 greedy
logprobs differed; the tokens happened to agree). ``cpu_linear.linear`` multiplies such a row as a
pair. The zoo's models all have K <= 512, below the threshold, so the engine-level check here builds
one whose down projection crosses it.

Pairing fixes only a lone row. On another machine oneDNN changed a row's bits between batches of
two or more rows as well (a GPU host's CPU, torch 2.11: bfloat16, and the engine's float32 path):
nothing in ``linear`` can mend that, so the oneDNN-path checks skip there, naming the shape and the
batch sizes found by oneDNN's own op (``onednn_batch_variance``), while the rows kernel's checks run.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN (mkldnn) is not available in this torch")

KS = (64, 576, 1024, 1088, 1536, 2048, 3072, 4096)  # both sides of every K blocking threshold seen
BATCHES = (1, 2, 3, 7, 33, 200)


def _packed(n: int, k: int, seed: int, dtype: torch.dtype = torch.float32):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5).to(dtype)
    return w, torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT)


ROWS = 16  # rows checked alone: a 16-bit output hides most order differences in any single row


def _x(k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(max(BATCHES) + ROWS, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


def _rows_alone_and_in_batches(product, x: torch.Tensor, batches=BATCHES) -> list[int]:
    """The batch sizes at which one of the first ROWS rows' results differs from its result alone."""
    alone = [product(x[r : r + 1])[0] for r in range(ROWS)]
    return [m for m in batches if any(not torch.equal(product(x[r : r + m])[0], alone[r]) for r in range(ROWS))]


def onednn_batch_variance(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> list[int]:
    """The batch sizes of three or more rows at which oneDNN's own op (no pairing, nothing of ours)
    gives one of the first ROWS rows of ``x`` other bits than the same row among two: there this
    machine's oneDNN is not batch-invariant for the shape, and no pairing of lone rows makes it so
    (the development machine's AMX gave bfloat16 rows other bits at 33 and 200 rows than at 2-7)."""
    raw = lambda rows: cpu_linear._product(rows.contiguous(), packed, bias)[0]  # noqa: E731
    pairs = [raw(x[r : r + 2]) for r in range(ROWS)]
    return [m for m in BATCHES if m > 2 and any(not torch.equal(raw(x[r : r + m]), pairs[r]) for r in range(ROWS))]


def onednn_sums_a_lone_row_apart(shapes, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this machine's oneDNN (its own op, no pairing) gives one of the first ROWS rows other
    bits alone than among two, for one of these weight shapes (N, K): the bad input the pairing of
    lone rows exists for. The development machine's AVX-512 oneDNN does at K = 1,536; an AVX2 one
    sums a lone row like a batch, so a control that turns the pairing off has nothing to show."""
    for n, k in shapes:
        w, packed = _packed(n, k, seed=n * 31 + k, dtype=dtype)
        raw = lambda rows, packed=packed: cpu_linear._product(rows.contiguous(), packed, None)  # noqa: E731
        if _rows_alone_and_in_batches(raw, _x(k, seed=n, dtype=dtype), batches=(2,)):
            return True
    return False


def require_onednn_batch_invariance(shapes, dtype: torch.dtype) -> None:
    """Skip, naming the shape and the batch sizes, where oneDNN's own op is not batch-invariant (rows of
    two or more) for one of these weight shapes (N, K), on random weights and rows."""
    for n, k in shapes:
        w, packed = _packed(n, k, seed=n * 31 + k, dtype=dtype)
        differ = onednn_batch_variance(packed, None, _x(k, seed=n, dtype=dtype))
        if differ:
            pytest.skip(
                f"this machine's oneDNN gives a {dtype} row of N={n}, K={k} other bits in batches of {differ} rows "
                "than among 2: no pairing of lone rows makes its products batch-invariant (float32 weights "
                "take the rows kernel where it is built)"
            )


DTYPES = [torch.float32] + [torch.bfloat16] * (torch.bfloat16 in cpu_linear.packable_dtypes())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", (48, 576))
@pytest.mark.parametrize("bias", (False, True))
def test_a_rows_product_is_the_same_alone_and_in_any_batch(k, n, bias, dtype):
    """A row alone (paired where oneDNN would sum it otherwise) equals the same row in batches of 2 to
    200, at every batch size where oneDNN's own op keeps a row's bits among two or more rows; where it
    does not (a machine property, ``onednn_batch_variance``), the sizes left out are named in a skip
    after the rest is checked."""
    w, packed = _packed(n, k, seed=k + n, dtype=dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x = _x(k, seed=k, dtype=dtype)
    variant = onednn_batch_variance(packed, b, x)
    batches = [m for m in BATCHES if m not in variant]
    differ = _rows_alone_and_in_batches(lambda rows: cpu_linear.linear(rows, w, b, packed), x, batches)
    assert not differ, f"K={k} {dtype}: a row alone differs from the same row in batches of {differ}"
    if variant:
        pytest.skip(
            f"checked at batches of {batches} rows only: this machine's oneDNN gives a {dtype} row of N={n}, K={k} "
            f"(bias={bias}) other bits in batches of {variant} rows than among 2 (its own op, no pairing)"
        )


def test_the_decision_is_asked_per_thread_count(monkeypatch):
    """The cached answer is per (shape, dtype, bias, thread count): oneDNN's order for one row can depend
    on the threads, and tests and engines change them within a process."""
    monkeypatch.setattr(cpu_linear, "_PAIR_SINGLE_ROWS", {})
    w, packed = _packed(48, 576, seed=2)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            cpu_linear.linear(torch.randn(1, 576), w, None, packed)
    finally:
        torch.set_num_threads(threads)
    assert sorted(key[-1] for key in cpu_linear._PAIR_SINGLE_ROWS) == [1, 2]


def test_the_rule_catches_onednn_called_directly():
    """Negative control: oneDNN's op itself, one row alone, at K = 1,536 (SmolLM2's down projection)."""
    w, packed = _packed(576, 1536, seed=1)
    raw = lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")  # noqa: E731
    x = _x(1536, seed=1)
    differ = _rows_alone_and_in_batches(raw, x)
    if not differ:
        pytest.skip("this machine's oneDNN sums one row like a batch at K=1536: there is no bad input to show")
    assert differ == list(BATCHES[1:])  # every batch differs from the row alone
    assert not onednn_batch_variance(packed, None, x), "float32 rows of 2+ differ among themselves here"


def test_the_rule_catches_a_probe_that_trusts_one_bfloat16_row(monkeypatch):
    """Negative control for 16-bit rows: deciding by one bfloat16 probe row (what the first version did)
    leaves lone rows unpaired at K = 1,536, and the rule sees rows that differ at batch sizes where
    oneDNN's own op keeps a row's bits."""
    if torch.bfloat16 not in cpu_linear.packable_dtypes():
        pytest.skip("this CPU's oneDNN does not run bfloat16 natively: those weights are not packed")
    w, packed = _packed(576, 1536, seed=1, dtype=torch.bfloat16)
    x = _x(1536, seed=1, dtype=torch.bfloat16)

    def one_row_probe(packed, bias, k, dtype):
        probe = torch.randn(2, k, generator=torch.Generator().manual_seed(0)).to(dtype)
        return not torch.equal(
            cpu_linear._product(probe[:1], packed, bias)[0], cpu_linear._product(probe, packed, bias)[0]
        )

    monkeypatch.setattr(cpu_linear, "_PAIR_SINGLE_ROWS", {})
    monkeypatch.setattr(cpu_linear, "_single_row_differs", one_row_probe)
    if one_row_probe(packed, None, 1536, torch.bfloat16):
        pytest.skip("one bfloat16 probe row shows the difference on this machine")
    batches = [m for m in BATCHES if m not in onednn_batch_variance(packed, None, x)]
    raw = lambda rows: cpu_linear._product(rows.contiguous(), packed, None)  # noqa: E731
    if not _rows_alone_and_in_batches(raw, x, batches):
        pytest.skip(
            f"this machine's oneDNN sums a lone bfloat16 row like the same row in batches of {batches} at K=1536 "
            "(its own op, unpaired): there is no bad input to show"
        )
    differ = _rows_alone_and_in_batches(lambda rows: cpu_linear.linear(rows, w, None, packed), x, batches)
    assert differ, f"a lone bfloat16 row left unpaired matched its batches of {batches}: the rule missed it"


@pytest.fixture(scope="module")
def wide_mlp_model():
    """A llama whose down projection has K = 1,536 (> 1,024), random seeded weights (the zoo's
    ``llama-wide-mlp``, which the conformance suite's batch-invariance rule uses too)."""
    pytest.importorskip("transformers", reason="the zoo builder writes the config with transformers")
    from conformance.zoo import zoo_model

    return zoo_model("llama-wide-mlp")


def _needle_logprobs(llm, batch_sizes) -> dict[int, list[float]]:
    from nanovllm import SamplingParams
    from tests.conftest import prompts_for

    needle = prompts_for(512, (21,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    out = {}
    for n in batch_sizes:
        batch = prompts_for(512, [5 + 7 * i for i in range(n - 1)], seed=n)
        pos = n // 2
        batch.insert(pos, needle)
        got = llm.generate(batch, params, use_tqdm=False)[pos].outputs[0]
        out[n] = [d[t] for t, d in zip(got.token_ids, got.logprobs)]
    return out


def _differing(by_batch: dict) -> list[int]:
    return [n for n, lp in by_batch.items() if lp != by_batch[1]]


# llama-wide-mlp's weight shapes (N, K): q/k/v, o, gate/up, down, LM head
WIDE_MLP_SHAPES = ((256, 128), (128, 128), (3072, 128), (128, 1536), (512, 128))


def _require_the_path(path: str) -> None:
    """The rows path needs the kernel; the oneDNN path, this machine's oneDNN batch-invariant for every
    weight shape of the model once lone rows are paired (``require_onednn_batch_invariance``)."""
    if path == "onednn":
        require_onednn_batch_invariance(WIDE_MLP_SHAPES, torch.float32)
    elif not cpu_linear.rows_enabled():
        pytest.skip(
            "the rows kernel is off here: the CPU kernels are built with neither AVX-512 nor AVX2, not built at all, "
            f"or NANOVLLM_CPU_KERNELS / {cpu_linear.ROWS_SWITCH} is 0"
        )


@pytest.mark.parametrize("path", ["onednn", "rows"])
def test_engine_logprobs_are_bitwise_the_same_alone_and_in_a_batch(wide_mlp_model, monkeypatch, path):
    """Float32 on the CPU: the needle's greedy logprobs, alone and among 1, 2 and 6 others, equal
    bitwise (decode steps at batch 1 go through K = 1,536), on either product: oneDNN's packed one
    and the rows kernel. Controls: a lone row summed in oneDNN's one-row order (oneDNN given the row as
    it is; the rows kernel given 512-element segments for it), and the same comparison fails."""
    from nanovllm import LLM, cpu_kernels
    from tests.conftest import engine_args

    _require_the_path(path)
    if path == "onednn":
        monkeypatch.setenv(cpu_linear.ROWS_SWITCH, "0")
    llm = LLM(wide_mlp_model, **engine_args("cpu", block_size=16, seed=0))
    try:
        down = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down.packed_weight, cpu_linear.RowsWeight) == (path == "rows")
        assert not _differing(_needle_logprobs(llm, (1, 2, 3, 7)))
        if path == "onednn":
            if not onednn_sums_a_lone_row_apart(WIDE_MLP_SHAPES):
                pytest.skip(
                    "checked: the logprobs are bitwise the same alone and in batches; not checked: the "
                    "control, which has no bad input here (this machine's oneDNN sums a lone row like a "
                    "batch at every weight shape of the model, so turning the pairing off changes nothing)"
                )
            monkeypatch.setattr(cpu_linear, "_PAIR_SINGLE_ROWS", {})
            monkeypatch.setattr(cpu_linear, "_single_row_differs", lambda *args: False)
        else:
            rows_linear = cpu_kernels.rows_linear

            def one_row_order(x, strips, n, bias, segment):
                return rows_linear(x, strips, n, bias, 512 if x.shape[0] == 1 else segment)

            monkeypatch.setattr(cpu_kernels, "rows_linear", one_row_order)
        assert _differing(_needle_logprobs(llm, (1, 2))) == [2], "the control shows nothing"
    finally:
        llm.close()


def test_the_rows_kernel_and_onednn_give_the_same_engine_bits(wide_mlp_model, monkeypatch):
    """The same requests through the engine with the rows kernel and with oneDNN's packed products
    (``NANOVLLM_CPU_ROWS_LINEAR=0``): the same tokens and the same logprobs, bitwise (K = 128, one
    chain, and K = 1,536, two segments; decode batches of 1 to 7 rows and a prefill), where this
    machine's oneDNN sums in the kernel's order (the development machine's). Control: the kernel given
    one chain over K (oneDNN's order only up to K = 512) and the comparison fails."""
    from nanovllm import LLM, SamplingParams, cpu_kernels
    from tests.conftest import engine_args, prompts_for
    from tests.test_cpu_rows_linear import require_onednns_order

    _require_the_path("rows")
    for n, k in WIDE_MLP_SHAPES:
        require_onednns_order(n, k)
    prompts = prompts_for(512, (3, 21, 40, 77, 9, 130, 15), seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)

    def run(rows: bool, one_chain: bool = False):
        monkeypatch.setenv(cpu_linear.ROWS_SWITCH, "1" if rows else "0")
        llm = LLM(wide_mlp_model, **engine_args("cpu", block_size=16, seed=0))
        try:
            if one_chain:
                rows_linear = cpu_kernels.rows_linear
                monkeypatch.setattr(
                    cpu_kernels,
                    "rows_linear",
                    lambda x, strips, n, bias, segment: rows_linear(x, strips, n, bias, x.shape[1]),
                )
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    onednn = run(rows=False)
    assert run(rows=True) == onednn
    assert run(rows=True, one_chain=True) != onednn, "the control shows nothing"  # last: its patch stays until teardown
