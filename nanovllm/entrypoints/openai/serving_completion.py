"""POST /v1/completions: text or token-id prompts (one or a list), ``n`` choices each (choice
``i * n + j``: prompt i, completion j), plain JSON or server-sent events (``text_completion``
chunks, then a usage chunk with ``stream_options.include_usage``, then ``[DONE]``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.entrypoints.openai.completion_logprobs import completion_logprobs, joined, prompt_logprobs_legacy
from nanovllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from nanovllm.entrypoints.openai.serving_common import (
    check_model,
    check_n,
    choices,
    merged,
    now,
    prompt_logprobs_json,
    random_id,
    refuse_constraints,
    sampling_params,
    sse,
    start,
    stream_error,
    usage,
)
from nanovllm.entrypoints.openai.stream_chunks import StreamChunks
from nanovllm.outputs import CompletionOutput, RequestOutput


def _nothing_generated(c: CompletionOutput) -> CompletionOutput:
    """``c`` as the answer of echo with max_tokens=0: no text, no tokens, finished by length."""
    reason = "length" if c.finish_reason in ("stop", "length") else c.finish_reason  # abort, error stay
    return CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None, reason, None)


def _prompts(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [p]
    if not p:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    return list(p)


def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many prompt logprobs the engine computes: the request's ``prompt_logprobs``, and with
    ``echo`` and ``logprobs`` at least ``logprobs`` (the echoed prompt's logprobs are the engine's
    prompt logprobs). A negative value goes through as given, to be refused by its name."""
    mine, echoed = req.prompt_logprobs, (req.logprobs if req.echo else None)
    if echoed is None or (mine is not None and (mine < 0 or echoed < 0)):
        return mine
    return echoed if mine is None else max(mine, echoed)


def _text_and_logprobs(
    req: CompletionRequest, out: RequestOutput, c: CompletionOutput, offset: int, echo: bool, tokenizer
) -> tuple[str, dict | None, int]:
    """A choice's text and legacy logprobs (text offsets from ``offset``), the prompt's first
    where ``echo`` (an echoing request's first answer), and the offset after them."""
    text, logprobs = c.text, None
    if echo:
        prompt = out.prompt or tokenizer.decode(out.prompt_token_ids)
        text, offset = prompt + text, offset + len(prompt)
        if req.logprobs is not None:  # offsets then add up the tokens' own texts, as vLLM's do
            logprobs, offset = prompt_logprobs_legacy(
                out, req.logprobs, req.return_tokens_as_token_ids, lambda t: tokenizer.decode([t])
            )
    completion, offset = completion_logprobs(c, offset, req.return_tokens_as_token_ids)
    return text, (completion if logprobs is None else joined(logprobs, completion)), offset


def _prompt_logprobs(req: CompletionRequest, out: RequestOutput) -> list | None:
    """The answer's ``prompt_logprobs``: only where the request asked for them, kept to its k."""
    return None if req.prompt_logprobs is None else prompt_logprobs_json(out, req.prompt_logprobs)


async def create_completion(
    engine: AsyncLLM, req: CompletionRequest, served: list[str], max_model_len: int, defaults: dict | None = None
):
    """The JSON response (a dict) or an async iterator of SSE lines."""
    check_model(req.model, served)
    refuse_constraints(req)
    check_n(req.n)
    if req.best_of is not None and req.best_of < req.n:
        raise OpenAIError(400, f"best_of must be >= n, got best_of={req.best_of}, n={req.n}", "best_of")
    if req.best_of is not None and req.best_of > req.n:
        raise OpenAIError(
            400,
            f"best_of={req.best_of} > n={req.n} is not supported: this engine does not rank "
            f"completions (best_of = n, or no best_of, returns every completion)",
            "best_of",
        )
    if req.suffix is not None:
        raise OpenAIError(400, f"suffix={req.suffix!r} is not supported", "suffix")
    # echo with max_tokens=0 scores the prompt and generates nothing: the engine runs the prompt
    # and one token, which the answer leaves out (as vLLM does)
    prompt_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError(
            400, "max_tokens=0 asks for no tokens: it is served only with echo=true (the prompt scored)", "max_tokens"
        )
    if prompt_only and req.min_tokens:
        raise OpenAIError(400, f"min_tokens={req.min_tokens} needs max_tokens >= {req.min_tokens}, got 0", "min_tokens")
    engine_req = req.model_copy(
        update={"prompt_logprobs": _engine_prompt_logprobs(req), "max_tokens": 1 if prompt_only else req.max_tokens}
    )
    prompts = [engine.encode_prompt(p) for p in _prompts(req)]
    lens = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts]
    params = [
        sampling_params(
            engine_req,
            prompt_len=n,
            max_model_len=max_model_len,
            logprobs=req.logprobs,
            max_tokens=engine_req.max_tokens,
            default_max_tokens=16,
            stream=req.stream,
            prompt_param="prompt",
            defaults=defaults,
        )
        for n in lens
    ]
    request_id = random_id("cmpl")
    # choice i * n + j: prompt i, completion j
    started = await start(
        engine,
        [p for p in prompts for _ in range(req.n)],
        [c for sp in params for c in choices(sp, req.n)],
        request_id,
        "prompt",
    )
    model = req.model or served[0]
    if req.stream:
        return _stream(req, started, request_id, model, engine.tokenizer, prompt_only)
    results, prompt_tokens, completion_tokens = [], 0, 0
    async with merged(started) as outputs:
        async for i, out in outputs:
            if not out.finished:
                continue
            c = out.outputs[0]
            if prompt_only:
                c = _nothing_generated(c)
            text, logprobs, _ = _text_and_logprobs(req, out, c, 0, req.echo, engine.tokenizer)
            results.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": _prompt_logprobs(req, out),
                }
            )
            if i % req.n == 0:  # a prompt counts once, whatever its n
                prompt_tokens += len(out.prompt_token_ids)
            completion_tokens += len(c.token_ids)
    results.sort(key=lambda ch: ch["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": results,
        "usage": usage(prompt_tokens, completion_tokens),
    }


async def _stream(
    req: CompletionRequest, started, request_id: str, model: str, tokenizer, prompt_only: bool
) -> AsyncIterator[str]:
    created = now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    n = len(started)
    prompt_tokens = [0] * n
    completion_tokens = [0] * n
    offsets = [0] * n
    echoed = [not req.echo] * n
    chunks = StreamChunks(request_id, "text_completion", created, model)
    try:
        async with merged(started) as outputs:
            async for i, out in outputs:
                c = out.outputs[0]
                if prompt_only:
                    c = _nothing_generated(c)
                prompt_tokens[i] = len(out.prompt_token_ids)
                completion_tokens[i] += len(c.token_ids)
                text, logprobs, offsets[i] = _text_and_logprobs(req, out, c, offsets[i], not echoed[i], tokenizer)
                echoed[i] = True
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                prompt_logprobs = _prompt_logprobs(req, out)
                if (
                    logprobs is None
                    and c.finish_reason is None
                    and c.stop_reason is None
                    and prompt_logprobs is None
                    and not continuous
                ):
                    yield chunks.text(i, text)  # most chunks: the same bytes as sse(chunk) below, faster
                    continue
                chunk: dict = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": i,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    ],
                }
                if prompt_logprobs is not None:
                    chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs
                if continuous:
                    chunk["usage"] = usage(prompt_tokens[i], completion_tokens[i])
                yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(sum(prompt_tokens[:: req.n]), sum(completion_tokens)),
                }
            )
    except Exception as e:  # noqa: BLE001 - the response has started: the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
