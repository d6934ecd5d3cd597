"""A stream the server's shutdown stops (uvicorn cancels what still runs when --shutdown-timeout
ends): it ends with an error event and [DONE], its body is closed (its engine request aborted),
and its last words never hold the process up, even for a client that stopped reading."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from nanovllm.entrypoints.openai.request_lifetime import (  # noqa: E402
    END_TIMEOUT_S,
    DisconnectAwareStreamingResponse,
)


def _stop_a_stream(client_reads: bool) -> tuple[float, list[dict], list[bool]]:
    """Stream, cancel the response's task once (the shutdown), and return how long it took to
    end, what was sent, and whether the body was closed."""
    closed: list[bool] = []

    async def body():
        try:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    async def main():
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
            if not client_reads and message["type"] == "http.response.body" and len(sent) > 3:
                await asyncio.Event().wait()  # a full socket: the client reads nothing more

        async def receive():
            await asyncio.Event().wait()  # no disconnect

        response = DisconnectAwareStreamingResponse(body(), media_type="text/event-stream")
        task = asyncio.ensure_future(response({"type": "http"}, receive, send))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        await asyncio.wait_for(task, 10 * END_TIMEOUT_S)
        return time.monotonic() - start, sent

    elapsed, sent = asyncio.run(main())
    return elapsed, sent, closed


def test_a_stopped_stream_ends_with_an_error_event_and_done():
    elapsed, sent, closed = _stop_a_stream(client_reads=True)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert b"the server is shutting down" in bodies[-2]["body"] and bodies[-2]["body"].endswith(b"data: [DONE]\n\n")
    assert bodies[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert closed and elapsed < END_TIMEOUT_S


def test_a_client_that_stopped_reading_does_not_hold_the_shutdown_up():
    """Its last words wait at most END_TIMEOUT_S (the event loop of a second Ctrl-C waits for
    every task: unbounded, the server never exited)."""
    elapsed, _, closed = _stop_a_stream(client_reads=False)
    assert closed and elapsed < END_TIMEOUT_S + 1.0, elapsed
