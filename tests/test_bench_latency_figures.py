"""`bench latency`'s figures against hand computations: the percentiles of a summary (numpy's
linear rule, on the 0-100 scale), TTFT from arrival (queue time included, as vLLM's), and the
timed loop (warm-up batches neither counted nor timed, fresh prompts in every batch) driven by a
stand-in LLM on a fake clock, so every figure has a closed form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanovllm.bench import latency
from nanovllm.bench.latency import LatencyResult, measure_batch_size, request_latencies
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(n_tokens: int, metrics: RequestMetrics) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(n_tokens)), None, None, "length")
    return RequestOutput("0", None, [1], [completion], True, metrics=metrics)


def test_summary_percentiles_are_the_linear_rule_on_a_0_to_100_scale():
    """Five values 10..50 ms: p50 is the middle one (30), p90 lies 0.6 of the way from the 4th to
    the 5th (40 + 0.6 * 10 = 46); tokens per second are the tokens over the summed batch times."""
    r = LatencyResult(
        batch_size=1,
        ttft=[0.050, 0.010, 0.040, 0.020, 0.030],
        tpot=[0.004, 0.002],
        batch_seconds=[1.0, 3.0],
        output_tokens=12,
    )
    s = r.summary()
    assert s["ttft_ms"] == pytest.approx({"p50": 30.0, "p90": 46.0})
    assert s["tpot_ms"] == pytest.approx({"p50": 3.0, "p90": 3.8})  # 2 + 0.9 * (4 - 2)
    assert s["batch_ms"] == pytest.approx({"p50": 2000.0, "p90": 2800.0})
    assert s["output_tokens_per_s"] == pytest.approx(12 / 4.0)
    assert (s["requests"], s["batches"]) == (5, 2)


def test_ttft_counts_from_arrival_not_from_the_first_schedule():
    """A request that queued 0.5 s before its first step: its TTFT is arrival -> first token (1.5 s,
    the metrics' own first_token_latency), not first step -> first token (1.0 s)."""
    m = RequestMetrics(100.0, 100.5, 101.5, 102.5, 102.5)
    ttft, tpot = request_latencies(_output(3, m))
    assert ttft == pytest.approx(1.5) and ttft == pytest.approx(m.first_token_latency)
    assert tpot == pytest.approx((102.5 - 101.5) / 2)  # 2 gaps after the first token


class _Clock:
    """perf_counter for latency.py: moves only when the stand-in LLM runs a batch."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _LLM:
    """A stand-in for LLM: each generate takes ``seconds`` on the clock; every request's first
    token comes 0.25 s after its arrival and one more token every 0.125 s."""

    def __init__(self, clock: _Clock, seconds: float) -> None:
        self.clock, self.seconds, self.batches = clock, seconds, []

    def generate(self, prompts, params, use_tqdm=False):
        self.batches.append([list(p) for p in prompts])
        start = self.clock.now
        self.clock.now += self.seconds
        n = params.max_tokens
        first = start + 0.25
        m = RequestMetrics(start, start, first, first + 0.125 * (n - 1), first + 0.125 * (n - 1))
        return [_output(n, m) for _ in prompts]


def test_timed_loop_excludes_warm_up_and_sends_fresh_prompts_every_batch(monkeypatch):
    """2 warm-up + 3 timed batches of 4 requests, 5 output tokens each, 2 s a batch: only the timed
    batches count (3 * 4 * 5 = 60 tokens in 6 s: 10 tok/s), and no prompt repeats in any batch
    (a repeated prompt would be served from the prefix cache, shortening its TTFT)."""
    clock = _Clock()
    monkeypatch.setattr(latency, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    llm = _LLM(clock, seconds=2.0)
    r = measure_batch_size(llm, 4, 6, 5, num_iters=3, num_warmup=2, vocab_size=97)
    assert len(llm.batches) == 5
    assert r.batch_seconds == [2.0, 2.0, 2.0]
    assert r.output_tokens == 3 * 4 * 5
    assert r.summary()["output_tokens_per_s"] == pytest.approx(60 / 6.0)
    assert r.ttft == pytest.approx([0.25] * 12) and r.tpot == pytest.approx([0.125] * 12)
    prompts = [tuple(p) for batch in llm.batches for p in batch]
    assert all(len(p) == 6 and all(0 <= t < 97 for t in p) for p in prompts)
    assert len(set(prompts)) == len(prompts), "a prompt was sent twice: a prefix-cache hit in a timed batch"
