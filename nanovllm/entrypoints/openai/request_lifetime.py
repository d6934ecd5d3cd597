"""How a request's HTTP exchange ends when the client or the server goes first.

- The client disconnects: the handler (or the stream) is cancelled and its engine requests are
  aborted at once.
- The server shuts down (SIGINT, SIGTERM): uvicorn stops taking connections and lets open
  requests run for ``--shutdown-timeout`` seconds, then cancels what is left. A stream cancelled
  so ends with an error event (503, "the server is shutting down") and ``data: [DONE]``, a plain
  request gets that 503 as its answer, and the engine requests are aborted; the server logs one
  line for it, not a traceback. Before, the stream was cut mid-answer, as if by a network fault.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.entrypoints.openai.protocol import OpenAIError
from nanovllm.entrypoints.openai.serving_common import sse

logger = logging.getLogger(__name__)
END_TIMEOUT_S = 1.0  # at most this long for a stopped request's last words and clean-up


def shutdown_error() -> OpenAIError:
    return OpenAIError(
        503,
        "the server is shutting down: this request was still running when its grace period "
        "(--shutdown-timeout) ended, and was stopped",
    )


def _stopped_by_shutdown() -> None:
    """The running task was cancelled by the server's shutdown: take the cancellation back, so
    the answer can still be sent."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
        task.uncancel()
    logger.warning("shutdown: a request still running after --shutdown-timeout was stopped (answered 503)")


async def _within(seconds: float, coro) -> None:
    """``coro``, given up after ``seconds``, or when the client has gone or the loop closes: the
    last words of a request stopped by the shutdown must never hold the process up (a client
    that stopped reading would, and a second Ctrl-C's loop waits for every task)."""
    try:
        await asyncio.wait_for(coro, seconds)
    except (asyncio.TimeoutError, asyncio.CancelledError, OSError):
        pass


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client's disconnect (whatever the ASGI version); either
    way the body iterator is closed at the end, so the request behind it is aborted at once. A
    stream the server's shutdown cancels ends with an error event and ``[DONE]``."""

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_and_note(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        streamer = asyncio.ensure_future(self.stream_response(send_and_note))
        listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
        stopped = False
        try:
            await asyncio.wait((streamer, listener), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server's shutdown: its grace period ran out
            stopped = True
            answered = streamer.done() and not streamer.cancelled()  # it ended as the cancel came
            for task in (streamer, listener):
                task.cancel()  # the streamer sends nothing more: it is suspended, and wakes cancelled
            if not answered:
                _stopped_by_shutdown()
                await _within(END_TIMEOUT_S, _end_stream(scope, receive, send, started))  # first: the loop may close
        finally:
            for task in (streamer, listener):
                task.cancel()
            cleanup = self._close(streamer, listener)
            if stopped:  # cancelled again meanwhile: the event loop is closing, the engine with it
                await _within(END_TIMEOUT_S, cleanup)
            else:
                await cleanup
        if stopped:
            return
        error = streamer.exception() if streamer.done() and not streamer.cancelled() else None
        if error is not None and not isinstance(error, OSError):  # OSError: the client went away
            raise error

    async def _close(self, *tasks: asyncio.Future) -> None:
        """The tasks' end, then the body iterator's: the request behind it is aborted."""
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  # our body is an async generator


async def _end_stream(scope, receive, send, started: bool) -> None:
    """The last events of a stream stopped by the shutdown (a 503 if nothing was sent yet)."""
    try:
        if not started:
            await JSONResponse(shutdown_error().body(), status_code=503)(scope, receive, send)
            return
        body = (sse(shutdown_error().body()) + sse("[DONE]")).encode()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except RuntimeError:  # the server had already ended the response (the stream's end raced the cancel)
        pass


def with_cancellation(handler):
    """Run a handler while listening for the client's disconnect; cancel the handler (and so
    abort its engine requests) if the client goes first. One the server's shutdown cancels
    answers 503."""

    @functools.wraps(handler)
    async def wrapper(body, raw_request: Request):
        task = asyncio.ensure_future(handler(body, raw_request))

        async def disconnected():
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass

        listener = asyncio.ensure_future(disconnected())
        stopped = False
        try:
            await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server's shutdown: its grace period ran out
            stopped = True
            _stopped_by_shutdown()
        finally:
            listener.cancel()
            if not task.done():
                task.cancel()
        if stopped:  # the handler, cancelled, aborts its engine requests on its way out
            return JSONResponse(shutdown_error().body(), status_code=503)
        if task.cancelled():
            return Response(status_code=499)  # nobody reads it: the client is gone
        return task.result()

    return wrapper
