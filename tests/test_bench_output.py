"""bench's outputs: --json-out files are strict JSON (an infinite request rate, bench serve's default,
was written as a bare Infinity, which JSON parsers refuse); a refused request's times."""

from __future__ import annotations

import json
import math

import pytest

from nanovllm.bench.json_out import finite, write_json


def test_non_finite_floats_are_written_as_strings(tmp_path):
    path = tmp_path / "r.json"
    write_json(str(path), {"request_rate": math.inf, "rows": [{"x": -math.inf, "y": math.nan, "z": 1.5}], "t": (1, 2)})
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    assert data == {"request_rate": "inf", "rows": [{"x": "-inf", "y": "nan", "z": 1.5}], "t": [1, 2]}


def test_the_control_plain_json_dump_writes_what_parsers_refuse():
    assert json.dumps({"request_rate": math.inf}) == '{"request_rate": Infinity}'
    assert finite({"a": [math.inf]}) == {"a": ["inf"]}


def test_a_refused_request_has_its_end_time():
    """bench serve's timeline: a request the server refused (HTTP 400) ends when its answer came,
    not at 0 (the run's 'last byte' read -57990 s when every request was refused)."""
    import asyncio
    import time

    aiohttp = pytest.importorskip("aiohttp", reason="the serve extra (aiohttp) is not installed")
    from aiohttp import web

    from nanovllm.bench.serve import one_request

    async def refuse(request):
        return web.json_response({"error": {"message": "no"}}, status=400)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                before = time.perf_counter()
                r = await one_request(session, f"http://127.0.0.1:{port}", "m", [1, 2], 4, 0.0)
                return before, r, time.perf_counter()
        finally:
            await runner.cleanup()

    before, r, after = asyncio.run(main())
    assert not r.ok and r.error.startswith("HTTP 400")
    assert before <= r.sent_at <= r.done_at <= after, (before, r.sent_at, r.done_at, after)
