"""/metrics before the first request: every per-model series is there at zero.

A labelled Prometheus metric shows no sample until its label values are used, so without the
start-up initialisation a scrape (or a test) that comes before any request finds no
``..._count`` line at all: on a GPU host's 16 xdist workers, test_serve's metrics check ran first
in its worker and failed that way.
"""

from __future__ import annotations

import re
import types

import pytest

pytest.importorskip("prometheus_client", reason="the server extra is not installed (pip install -e '.[serve]')")

from nanovllm.entrypoints.openai.metrics import ServerMetrics  # noqa: E402

STATS = {
    "num_kv_blocks": 8,
    "prefix_cache_query_tokens": 0,
    "prefix_cache_hit_tokens": 0,
    "running": 0,
    "waiting": 0,
    "num_free_kv_blocks": 8,
    "preemptions": 0,
    "steps": 0,
}
SERIES = [
    "nanovllm:time_to_first_token_seconds_count",
    "nanovllm:inter_token_latency_seconds_count",
    "nanovllm:e2e_request_latency_seconds_count",
    "nanovllm:request_queue_time_seconds_count",
    "nanovllm:request_prompt_tokens_count",
    "nanovllm:request_generation_tokens_count",
    "nanovllm:generation_tokens_total",
    "nanovllm:prompt_tokens_total",
]


def test_every_series_is_scrapable_at_zero_before_any_request():
    engine = types.SimpleNamespace(stats=dict(STATS), output_observers=[])
    text = ServerMetrics(engine, "m").render().decode()
    for name in SERIES:
        m = re.search(rf'^{re.escape(name)}\{{model_name="m"\}} (\S+)$', text, re.M)
        assert m, f"{name} missing from a fresh server's /metrics"
        assert float(m.group(1)) == 0.0
