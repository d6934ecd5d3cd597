"""The decode kernel's split-K factor (``triton_ops.num_decode_splits``): the smallest power of
two that gives at least ``waves x SMs`` programs, capped at ``MAX_SPLITS``; the default ``waves``
is the module's ``FP8_DECODE_SPLIT_WAVES`` for an FP8 cache and ``DECODE_SPLIT_WAVES`` otherwise
(what the engine's graphs are captured with), and the workspace ``reserve`` sizes follows the
cache's rule."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the split rule lives in the Triton kernels' module")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanovllm.attention import triton_ops  # noqa: E402
from nanovllm.attention.triton_backend import TritonBackend  # noqa: E402

shapes = dict(
    num_seqs=st.integers(1, 600),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    num_sms=st.sampled_from([4, 78, 132]),
    waves=st.sampled_from([1, 2, 4, 8, 16]),
)


def check_rule(rule, num_seqs, num_kv_heads, num_sms, waves):
    splits = rule(num_seqs, num_kv_heads, num_sms, waves)
    programs, target = num_seqs * num_kv_heads, waves * num_sms
    assert 1 <= splits <= triton_ops.MAX_SPLITS and splits & (splits - 1) == 0, splits
    if splits < triton_ops.MAX_SPLITS:
        assert programs * splits >= target, (programs, splits, target)  # enough programs
    if splits > 1:
        assert programs * splits // 2 < target, (programs, splits, target)  # and no more than needed


@given(**shapes)
def test_splits_are_the_smallest_power_of_two_that_fills_the_waves(num_seqs, num_kv_heads, num_sms, waves):
    check_rule(triton_ops.num_decode_splits, num_seqs, num_kv_heads, num_sms, waves)


def test_the_rule_check_refuses_a_factor_rounded_down():
    """Control: the check above fails for a rule that rounds the factor down."""

    def rounded_down(num_seqs, num_kv_heads, num_sms, waves):
        exact = max(1, waves * num_sms // (num_seqs * num_kv_heads))
        return min(triton_ops.MAX_SPLITS, 1 << (exact.bit_length() - 1))

    with pytest.raises(AssertionError):
        check_rule(rounded_down, 23, 8, 132, 8)  # 184 programs: 1056 / 184 = 5.7 -> 8, not 4


def test_the_default_waves_is_the_module_setting_and_the_workspace_follows_it(monkeypatch):
    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 2)
    monkeypatch.setattr(triton_ops, "FP8_DECODE_SPLIT_WAVES", 8)
    assert triton_ops.num_decode_splits(23, 8, 132) == 2  # 264 / 184 -> 2
    assert triton_ops.num_decode_splits(23, 8, 132, kv_fp8=True) == 8  # 1056 / 184 -> 8
    assert triton_ops.num_decode_splits(129, 8, 132, kv_fp8=True) == 2  # 1056 / 1032 -> 2 (16-bit: 1)
    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 8)
    assert triton_ops.num_decode_splits(23, 8, 132) == 8  # 1056 / 184 -> 8
    import torch

    backend = TritonBackend()
    backend.reserve(4, num_heads=16, num_kv_heads=8, head_dim=64, device=torch.device("cpu"), kv_dtype=torch.bfloat16)
    # the CPU stand-in has 4 SMs, 32 programs aimed at: batches 1-4 get 4, 2, 2, 1 splits, so
    # 64, 64, 96, 64 rows of 16 heads; the workspace holds the most (batch 3)
    assert backend._lse.numel() == 96 and backend._partials.numel() == 96 * 64
    # 16-bit caches at 2 waves (8 programs aimed at: 1 split each, 64 rows at most); FP8 at 8 (96)
    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 2)
    backend = TritonBackend()
    backend.reserve(4, 16, 8, 64, torch.device("cpu"), kv_dtype=torch.bfloat16)
    assert backend._lse.numel() == 64
    backend = TritonBackend()
    backend.reserve(4, 16, 8, 64, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn)
    assert backend._lse.numel() == 96 and backend.num_splits(3, 8, torch.device("cpu"), kv_fp8=True) == 2


def test_a_decode_step_splits_as_its_cache_type_says(monkeypatch):
    """The backend's decode call asks for the FP8 rule on an FP8 cache (what ``reserve`` sized the
    workspace for): a batch of 3 on the CPU stand-in's 4 SMs, 24 programs, splits once at 2 waves
    and twice at 8; a call that asked for the 16-bit rule on both would give [1, 1]."""
    import torch

    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 2)
    monkeypatch.setattr(triton_ops, "FP8_DECODE_SPLIT_WAVES", 8)
    seen = []
    monkeypatch.setattr(triton_ops, "paged_decode", lambda *a, num_splits, **kw: seen.append(num_splits))
    backend = TritonBackend()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.zeros(2, 16, 8, 64, dtype=dtype)
        backend._decode(torch.zeros(3, 16, 64), cache, cache, None, None, 1.0, 1.0, 1.0)
    assert seen == [1, 2]


def test_a_step_that_outgrows_the_reserved_workspace_raises(monkeypatch):
    """A workspace ``reserve`` sized is not grown later: CUDA graphs captured on it would read the
    freed buffer. The case that would do it: a reserve with the 16-bit rule, then an FP8 decode step
    (a batch of 3: 96 rows against 64). Control: without a reserve, an eager caller's workspace grows."""
    import torch

    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 2)
    monkeypatch.setattr(triton_ops, "FP8_DECODE_SPLIT_WAVES", 8)
    monkeypatch.setattr(triton_ops, "paged_decode", lambda *a, **kw: None)
    cpu = torch.device("cpu")
    fp8 = torch.zeros(2, 16, 8, 64, dtype=torch.float8_e4m3fn)
    backend = TritonBackend()
    backend.reserve(4, 16, 8, 64, cpu, kv_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="96 rows, more than the 64 that reserve"):
        backend._decode(torch.zeros(3, 16, 64), fp8, fp8, None, None, 1.0, 1.0, 1.0)
    backend.reserve(4, 16, 8, 64, cpu, kv_dtype=torch.float8_e4m3fn)  # the cache's own rule: fits
    backend._decode(torch.zeros(3, 16, 64), fp8, fp8, None, None, 1.0, 1.0, 1.0)
    eager = TritonBackend()
    eager._decode(torch.zeros(3, 16, 64), fp8, fp8, None, None, 1.0, 1.0, 1.0)
    assert eager._lse.numel() == 96


def _allocate_on_a_stub_runner(monkeypatch, kv_dtype, block_size: int = 16, max_model_len: int = 100) -> TritonBackend:
    """``ModelRunner.allocate_kv_cache`` on a stand-in runner (16 query and 8 KV heads of 64, 4
    sequences, the CPU): the backend it reserved on."""
    from types import SimpleNamespace

    from nanovllm.worker.model_runner import ModelRunner

    backend = TritonBackend()
    monkeypatch.setattr(backend, "new_kv_cache", lambda *a: torch.empty(0))
    runner = SimpleNamespace(
        attn_layers=[SimpleNamespace(num_heads=16, num_kv_heads=8, head_dim=64)],
        backend=backend,
        block_size=block_size,
        kv_dtype=kv_dtype,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        config=SimpleNamespace(max_num_seqs=4, max_model_len=max_model_len),
    )
    ModelRunner.allocate_kv_cache(runner, 2, capture_graphs=False)
    return backend


@pytest.mark.parametrize("kv_dtype,rows", [("float8_e4m3fn", 96), ("bfloat16", 64)])
def test_the_runner_reserves_the_workspace_for_its_cache_dtype(monkeypatch, kv_dtype, rows):
    """``ModelRunner.allocate_kv_cache`` hands its cache dtype to ``reserve``: the FP8 rule sizes
    96 rows for 4 sequences of 16 heads on the CPU stand-in's 4 SMs, the 16-bit rule 64."""
    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", 2)
    monkeypatch.setattr(triton_ops, "FP8_DECODE_SPLIT_WAVES", 8)
    backend = _allocate_on_a_stub_runner(monkeypatch, getattr(torch, kv_dtype))
    assert backend._reserved_rows == rows and backend._lse.numel() == rows
    assert backend._streamk is None, "the stream-K decode is off by default: nothing reserved for it"


def test_the_runner_reserves_the_streamk_workspace_when_it_is_on(monkeypatch):
    """With ``DECODE_STREAMK`` on, ``reserve`` also sizes the stream-K buffers: ``max_num_seqs``
    sequences of the widest block table (``max_model_len`` 70 rounded up to whole 64-slot blocks:
    128 slots, so 4 tiles of the smallest, 32-key, tiles; 70 slots unrounded would give 3, too few
    for a decode at the widest table), the CPU stand-in's programs (4 SMs x 3); a step that needs
    more then raises, before any buffer is freed."""
    from nanovllm.attention import decode_streamk, triton_backend

    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "1")
    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (1, 1024))  # the stub's 4 sequences
    backend = _allocate_on_a_stub_runner(monkeypatch, torch.bfloat16, block_size=64, max_model_len=70)
    programs = 4 * decode_streamk.PROGRAMS_PER_SM
    ws = backend._streamk
    assert backend._streamk_reserved and ws.size == (4, 4, 8, 2, 64, programs)
    assert ws.tile_map.numel() == 4 * 8 * 4 and ws.lse.numel() == (4 * 8 + programs) * 2
    assert ws.item_start.numel() == 4 * 8 + 1 and ws.partials.numel() == (4 * 8 + programs) * 2 * 64
    assert backend._streamk_workspace(4, 4, 8, 2, 64, torch.device("cpu"))[0] is ws  # fits: the same buffers
    for bigger in [(5, 4, 8, 2, 64), (4, 5, 8, 2, 64), (4, 4, 8, 2, 128), (4, 4, 4, 4, 64)]:
        with pytest.raises(RuntimeError, match="reserve"):
            backend._streamk_workspace(*bigger, torch.device("cpu"))
    assert backend._streamk is ws


def test_a_streamk_workspace_holds_only_what_it_was_sized_for():
    """``StreamKWorkspace.holds``: fewer sequences, tiles or programs fit; more of any, or other head
    shapes (its buffers' sizes multiply them), do not: ``paged_decode_streamk`` refuses those."""
    from nanovllm.attention import decode_streamk

    ws = decode_streamk.StreamKWorkspace.allocate(4, 10, 8, 2, 64, 12, "cpu")
    assert ws.holds(4, 10, 8, 2, 64, 12) and ws.holds(1, 3, 8, 2, 64, 5)
    for shape in [(5, 10, 8, 2, 64, 12), (4, 11, 8, 2, 64, 12), (4, 10, 8, 2, 64, 13), (4, 10, 4, 4, 64, 12)]:
        assert not ws.holds(*shape), shape


@pytest.mark.parametrize(
    "mode,fp8,tma,rows,taken",
    [
        ("fp8", True, True, 16, True),  # the default: an FP8 cache read as TMA boxes, within the range
        ("fp8", True, True, 128, True),
        ("fp8", True, True, 15, False),  # below the range
        ("fp8", True, True, 129, False),  # above it
        ("fp8", True, False, 64, False),  # no TMA boxes (a float32 model, no Hopper GPU): not measured
        ("fp8", False, True, 64, False),  # a 16-bit cache
        ("1", False, False, 64, True),  # every cache
        ("1", False, False, 200, False),  # ... still within the range only
        ("0", True, True, 64, False),
    ],
)
def test_which_decodes_the_streamk_kernel_takes(mode, fp8, tma, rows, taken, monkeypatch):
    """``TritonBackend._streamk_takes``: the switch, the batch range (default 16:128) and, for the
    default switch, an FP8 cache whose tiles are TMA boxes, the one configuration measured faster."""
    from nanovllm.attention import triton_backend, triton_ops

    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", mode)
    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (16, 128))
    monkeypatch.setattr(triton_ops, "wants_tma", lambda q, k, v: tma)
    q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 256, 8, 128, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert triton_backend.TritonBackend._streamk_takes(q, cache, cache) is taken
