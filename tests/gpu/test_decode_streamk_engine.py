"""The stream-K decode in the engine (``NANOVLLM_DECODE_STREAMK``; KERNEL_NOTES sessions 25-26), with
CUDA graphs captured on it, at every batch size (the engine's default range, ``STREAMK_BATCHES``,
starts above these tests' batches):

- a float32 model, whose dots are exact, with its own float32 cache and with an FP8 one: the
  shipped decode kernel's greedy tokens exactly (the two kernels differ only in the order of their
  sums, far below the logit gaps greedy decoding depends on);
- a bfloat16 model with an FP8 cache, the path stream-K is for by default (TMA boxes, V widened by
  PTX and clamped finite, registers capped), and with a bfloat16 cache (masked loads, registers
  capped): each decoded token's logprob within ``LOGPROB_TOL`` of the
  shipped kernel's, up to where the greedy tokens first differ (random-weight models sit on
  near-ties that bfloat16 flips). The first decoded token of every prompt always compares (the
  token before it comes from the prefill, which both share).

Each has a control: the stream-K kernel told a wrong softmax scale fails the same check."""

from __future__ import annotations

import pytest
import torch

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import engine_args, prompts_for

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MODEL = "qwen3-gqa4-hd128"


LOGPROB_TOL = 0.1


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_streamk_decode_gives_the_shipped_kernels_tokens(kv, monkeypatch):
    from nanovllm.attention import decode_streamk, triton_backend

    if kv == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9 or newer")
    calls = []
    real = decode_streamk.paged_decode_streamk
    monkeypatch.setattr(
        decode_streamk, "paged_decode_streamk", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw)
    )
    prompts = prompts_for(ZOO[MODEL].vocab_size, [3, 17, 40, 90, 130, 300], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(mode: str) -> list[list[int]]:
        monkeypatch.setattr(triton_backend, "DECODE_STREAMK", mode)
        monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (1, 1024))  # the test's batches are small
        with LLM(zoo_model(MODEL), **engine_args("cuda", kv_cache_dtype=kv, max_model_len=512)) as llm:
            assert llm.llm_engine.executor.runner.graphs is not None, "the decode steps must run as CUDA graphs"
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    shipped = run("0")
    assert calls == [], "switch off: the shipped kernel only"
    streamk = run("1")
    assert calls, "switch on: the graphs were captured on the stream-K kernel"
    assert streamk == shipped
    # control: the same engine with the stream-K kernel told a wrong softmax scale gives other tokens
    monkeypatch.setattr(
        decode_streamk,
        "paged_decode_streamk",
        lambda q, k, v, bt, sl, scale, **kw: real(q, k, v, bt, sl, 4 * scale, **kw),
    )
    assert run("1") != shipped, "control: a wrong stream-K kernel must change the tokens"


def _logprob_gap(a, b) -> tuple[float, int]:
    """The largest difference between two runs' logprobs of run ``a``'s decoded tokens (position 1
    on: position 0 comes from the prefill), each prompt up to and including its first position whose
    tokens differ (the contexts are the same up to there), and how many positions it compared. A
    token missing from ``b``'s top logprobs counts as an infinite difference."""
    worst, compared = 0.0, 0
    for x, y in zip(a, b):
        assert x.token_ids[0] == y.token_ids[0], "the prefill's token must be the same"
        for pos in range(1, len(x.token_ids)):
            tok = x.token_ids[pos]
            other = y.logprobs[pos].get(tok)
            worst = max(worst, float("inf") if other is None else abs(x.logprobs[pos][tok].logprob - other.logprob))
            compared += 1
            if y.token_ids[pos] != tok:
                break
    return worst, compared


@pytest.mark.parametrize("kv", ["fp8", "auto"])
def test_streamk_decode_on_a_bfloat16_model_keeps_the_logprobs(kv, monkeypatch):
    """``fp8``: TMA boxes, V widened by PTX and clamped finite. ``auto`` (a bfloat16 cache): masked
    loads, V's rows past each end zeroed by the load itself (no zeroing in registers), registers
    capped so 3 CTAs fit an SM (``decode_streamk.register_cap``)."""
    from nanovllm.attention import decode_streamk, triton_backend

    if kv == "fp8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 path stream-K is for reads TMA boxes: compute capability 9.0 or newer")
    mode = "fp8" if kv == "fp8" else "1"
    prompts = prompts_for(ZOO[MODEL].vocab_size, [3, 17, 40, 90, 130, 300], seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    real = decode_streamk.paged_decode_streamk

    def run(mode: str):
        monkeypatch.setattr(triton_backend, "DECODE_STREAMK", mode)
        monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (1, 1024))  # the test's batches are small
        args = engine_args("cuda", dtype="bfloat16", kv_cache_dtype=kv, max_model_len=512)
        with LLM(zoo_model(MODEL), **args) as llm:
            assert llm.llm_engine.executor.runner.graphs is not None
            return [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]

    shipped = run("0")
    gap, compared = _logprob_gap(shipped, run(mode))
    assert compared >= len(prompts), compared
    assert gap <= LOGPROB_TOL, f"stream-K logprobs differ from the shipped kernel's by {gap:.4f} > {LOGPROB_TOL}"
    monkeypatch.setattr(
        decode_streamk,
        "paged_decode_streamk",
        lambda q, k, v, bt, sl, scale, **kw: real(q, k, v, bt, sl, 4 * scale, **kw),
    )
    gap, _ = _logprob_gap(shipped, run(mode))
    assert gap > LOGPROB_TOL, f"control: a wrong stream-K kernel moves the logprobs by only {gap:.4f}"
