"""A scripted OpenAI completions server on a loopback port, for the bench serve client's tests:
``one_request_against(handler)`` serves POST /v1/completions with an aiohttp handler, sends
bench serve's one request (prompt [1, 2], 4 tokens, greedy) and returns
``(perf_counter before sending, the RequestResult, perf_counter after)``."""

from __future__ import annotations

import time


async def one_request_against(handler):
    import aiohttp
    from aiohttp import web

    from nanovllm.bench.serve import one_request

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            before = time.perf_counter()
            result = await one_request(session, f"http://127.0.0.1:{port}", "m", [1, 2], 4, 0.0)
            return before, result, time.perf_counter()
    finally:
        await runner.cleanup()
