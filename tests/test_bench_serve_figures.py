"""`bench serve`'s figures against hand computations: a summary of hand-made results with a failed
request (rates count completed requests; every completed request's first chunk is a chunk), and
the client's inter-token latencies against a scripted stream with known gaps (each gap is since
the previous chunk, so they add up to no more than the stream's span)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from nanovllm.bench.serve import RequestResult, ServeMeasurement


def _measured() -> ServeMeasurement:
    """2 completed requests (3 tokens in 3 chunks, 2 tokens in 1 chunk) and 1 failed, in 2 s;
    the server spent 0.4 s of CPU."""
    results = [
        RequestResult(ok=True, output_tokens=3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2], sent_at=0.0, done_at=0.5),
        RequestResult(ok=True, output_tokens=2, ttft=0.3, e2e=0.3, itl=[], sent_at=0.5, done_at=0.8),
        RequestResult(ok=False, error="HTTP 400", sent_at=1.0, done_at=1.1),
    ]
    return ServeMeasurement("x", 2.0, results, client_cpu_s=[0.5], server_cpu_s=0.4)


def test_summary_rates_count_completed_requests_and_every_chunk():
    s = _measured().summary()
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 5)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert s["requests_per_s"] == pytest.approx(2 / 2.0)  # the failed request is not a served one
    busy = s["cpu_busy"]
    # chunks: 1 + 2 ITL gaps for the first request, 1 for the second: 4
    assert busy["tokens_per_chunk"] == pytest.approx(5 / 4)
    assert busy["server_cpu_ms_per_chunk"] == pytest.approx(0.4 / 4 * 1e3)
    assert busy["client_busiest"] == pytest.approx(0.5 / 2.0) and busy["server_process"] == pytest.approx(0.4 / 2.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    assert s["itl_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p90": 200.0, "p99": 200.0})


GAP = 0.1  # seconds between the scripted server's chunks


def test_inter_token_latency_is_the_gap_since_the_previous_chunk():
    """A scripted server streams 4 token chunks GAP apart, then the usage chunk: the client sees 3
    gaps, which add up to no more than the time from the first chunk to the end (e2e - TTFT);
    gaps measured from the request's start add up to about 6 GAP, twice that."""
    pytest.importorskip("aiohttp", reason="the serve extra (aiohttp) is not installed")
    from aiohttp import web

    from tests.scripted_server import one_request_against

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(4):
            if i:
                await asyncio.sleep(GAP)
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    start, r, _ = asyncio.run(one_request_against(stream))
    assert r.ok and r.output_tokens == 4, r.error
    assert len(r.itl) == 3 and all(x >= 0 for x in r.itl), r.itl  # a gap is 0 where two chunks came in one read
    assert sum(r.itl) <= r.e2e - r.ttft + 1e-6, (r.itl, r.ttft, r.e2e)
    assert r.e2e <= time.perf_counter() - start


def test_warm_up_requests_stay_below_the_models_vocabulary(monkeypatch):
    """The warm-up before a served run shifts the first prompts' ids by one so that they share no
    cached prefix; shifted past the vocabulary, the server refuses them and nothing is warmed.
    A vocabulary of 7 and ids of 6: every warm-up id is below 7 (the offline bench's warm-up
    wraps at the vocabulary too)."""
    from types import SimpleNamespace

    import nanovllm.bench.serve as serve_mod
    from nanovllm.bench.workloads import Workload

    sent = []

    async def fake_run_requests(url, model, w, *a, **k):
        sent.append(w)
        return ServeMeasurement("", 1.0, [])

    monkeypatch.setattr(serve_mod, "run_requests", fake_run_requests)
    monkeypatch.setattr(serve_mod, "run_split", lambda *a, **k: ServeMeasurement("", 1.0, []))
    monkeypatch.setattr(serve_mod, "server_cpu_seconds", lambda *a, **k: None)
    w = Workload("random", [[6] * 40, [5, 6, 0]], [3, 3], 0.0, vocab_size=7)
    args = SimpleNamespace(api_key=None, client_processes=1, request_rate=float("inf"), max_concurrency=None)
    serve_mod.measure("http://127.0.0.1:1", "m", w, args)
    assert len(sent) == 1 and sent[0].prompts, sent
    ids = [t for p in sent[0].prompts for t in p]
    assert all(0 <= t < 7 for t in ids), ids
    assert sent[0].prompts[1] == [6, 0, 1]  # still shifted by one: no prefix shared with the workload
