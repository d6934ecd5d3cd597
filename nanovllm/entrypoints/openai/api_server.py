"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM, run by uvicorn.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize, /detokenize,
/metrics (and /debug/engine when NANOVLLM_SERVER_DEV_MODE=1: checks the engine's invariants and
returns its stats, for tests). Every error is OpenAI's error object with a 4xx/503 status that
names the field: malformed JSON and wrong types (400, the field's path), bad values (400),
unknown model (404), missing or wrong API key (401), a dead engine (503). A client that
disconnects has its request aborted, streaming or not.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import signal
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm import __version__ as nanovllm_version
from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.entrypoints.openai.cli_args import DEFAULT_SHUTDOWN_TIMEOUT_S, served_names
from nanovllm.entrypoints.openai.http_options import add_cors, uvicorn_options
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from nanovllm.entrypoints.openai.request_errors import validation_error
from nanovllm.entrypoints.openai.request_lifetime import DisconnectAwareStreamingResponse, with_cancellation
from nanovllm.entrypoints.openai.serving_chat import (
    apply_chat_template,
    create_chat_completion,
    refuse_request_template,
)
from nanovllm.entrypoints.openai.serving_common import check_model
from nanovllm.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)
DEV_MODE_ENV = "NANOVLLM_SERVER_DEV_MODE"
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (load balancers, scrapers)


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer KEY`` (plain ASGI: streamed responses pass untouched)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    OpenAIError(
                        401,
                        "invalid or missing API key (Authorization: Bearer KEY)",
                        "Authorization",
                        "invalid_api_key",
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None = None,
    dev_mode: bool | None = None,
    metrics_dir: str | None = None,
    sampling_defaults: dict | None = None,
    metrics_prefix: str = "nanovllm",
    chat_template: str | None = None,
    http_options: dict | None = None,
) -> FastAPI:
    """The app over ``engine``; ``metrics_dir``: a Prometheus multiprocess directory shared with
    the server's other front-end processes (``api_server_pool.py``); ``sampling_defaults``: what a
    request gets for a sampling field it leaves out (``generation_defaults.py``);
    ``metrics_prefix``: ``vllm`` names the series vLLM also has as vLLM does (``metrics.py``);
    ``chat_template``: a template's text for every chat prompt instead of the model's own;
    ``http_options``: CORS (``http_options.py``)."""
    app = FastAPI(title="nanovllm OpenAI-compatible server", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine, served_model_names[0], multiprocess_dir=metrics_dir, prefix=metrics_prefix)
    max_model_len = engine.max_model_len
    defaults = dict(sampling_defaults or {})
    created = int(time.time())
    dev_mode = os.environ.get(DEV_MODE_ENV) == "1" if dev_mode is None else dev_mode
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and kind != "application/json":  # as vLLM: 415, saying what to send
            return error_response(
                OpenAIError(
                    415,
                    f"Content-Type must be application/json, got {kind or 'none'!r} "
                    "(curl: -H 'Content-Type: application/json')",
                    "Content-Type",
                )
            )
        return error_response(validation_error([{**e, "loc": e.get("loc", ())[1:]} for e in exc.errors()]))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_, exc: Exception):  # logged with its traceback here, never sent to the client
        logger.exception("unexpected error while serving a request")
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}"))

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    add_cors(app, http_options)  # after (outside) the key check: preflights carry no key

    def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return DisconnectAwareStreamingResponse(result, media_type="text/event-stream")

    def _check_alive() -> None:
        if engine.errored is not None:
            raise OpenAIError(503, f"the engine failed and serves no more requests: {engine.errored!r}")

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(body: CompletionRequest, raw_request: Request):
        _check_alive()
        return _respond(await create_completion(engine, body, served_model_names, max_model_len, defaults))

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        _check_alive()
        return _respond(
            await create_chat_completion(engine, body, served_model_names, max_model_len, defaults, chat_template)
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "nanovllm",
                    "root": engine.model_dir,
                    "max_model_len": max_model_len,
                }
                for name in served_model_names
            ],
        }

    @app.get("/version")
    async def version():
        return {"version": nanovllm_version}

    @app.get("/health")
    async def health():
        if not engine.is_running and engine.errored is not None:
            return error_response(OpenAIError(503, f"the engine failed: {engine.errored!r}"))
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model, served_model_names)
        refuse_request_template(body)
        tok = engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this model has no tokenizer", "prompt")
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = apply_chat_template(
                tok,
                ChatCompletionRequest(
                    messages=body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template_kwargs=body.chat_template_kwargs,
                ),
                chat_template,
            )["prompt_token_ids"]
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, served_model_names)
        vocab = engine.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise OpenAIError(400, f"tokens[{i}]={t} is outside the vocabulary [0, {vocab})", f"tokens[{i}]")
        if engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if dev_mode:

        @app.get("/debug/engine")
        async def debug_engine():
            """Checks the engine's invariants between steps; returns its stats, its live requests
            and which front-end process answered."""
            state = await engine.call(engine_state)
            return {**state, "front_end_pid": os.getpid(), "front_end_finished": metrics.finished_here}

    return app


def engine_state(engine) -> dict:
    """/debug/engine: the engine's invariants checked, its stats and live requests (a module-level
    function: it runs in the engine-core process)."""
    engine.check_invariants()
    return {"stats": engine.stats(), "requests": sorted(engine.requests)}


async def serve(args, engine_kwargs: dict, sock=None) -> None:
    """Load the model, then serve until SIGINT/SIGTERM (uvicorn's handlers); the engine is shut
    down on the way out. The port opens only once the model is loaded: /health answers 200 then.
    ``sock``: the address bound before the load (``server_socket.bind_socket``); without it
    uvicorn binds ``args.host``/``args.port`` itself."""
    import uvicorn

    loop = asyncio.get_running_loop()
    logger.info("event loop: %s.%s", type(loop).__module__, type(loop).__name__)
    engine = await loop.run_in_executor(
        None,
        functools.partial(
            AsyncLLM.from_engine_args,
            args.model,
            engine_process=getattr(args, "core_process", True),
            load_format=getattr(args, "load_format", "auto"),
            **engine_kwargs,
        ),
    )
    # uvicorn stops gracefully on SIGTERM, then raises the signal again: with the default handler
    # that killed the process before the engine below was shut down (its core and TP workers then
    # left on their own, on a closed pipe). This handler makes the re-raise an exit instead.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        app = build_app(
            engine,
            served_names(args),
            api_key=args.api_key,
            sampling_defaults=getattr(args, "sampling_defaults", None),
            metrics_prefix=getattr(args, "metrics_prefix", "nanovllm"),
            chat_template=getattr(args, "chat_template_text", None),
            http_options=getattr(args, "http_options", None),
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S),
            **uvicorn_options(getattr(args, "http_options", None)),
        )
        await uvicorn.Server(config).serve(sockets=None if sock is None else [sock])
    finally:
        engine.shutdown()
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # the status a shell reports for a process ended by SIGTERM
