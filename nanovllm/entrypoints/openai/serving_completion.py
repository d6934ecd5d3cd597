"""POST /v1/completions: text or token-id prompts (one or a list), ``n`` choices each (choice
``i * n + j``: prompt i, completion j), plain JSON or server-sent events (``text_completion``
chunks, then a usage chunk with ``stream_options.include_usage``, then ``[DONE]``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM
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
from nanovllm.outputs import CompletionOutput

LOGPROB_FLOOR = -9999.0  # -inf is not JSON: vLLM's floor


def _prompts(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [p]
    if not p:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    return list(p)


def token_name(token_id: int, decoded: str | None, as_id: bool) -> str:
    """A logprob entry's token: its text, or vLLM's ``token_id:N`` (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_id else (decoded or "")


def completion_logprobs(c: CompletionOutput, offset: int, as_ids: bool = False) -> dict | None:
    """OpenAI's legacy logprobs object for the tokens of ``c`` (text offsets from ``offset``);
    ``as_ids``: tokens (and top_logprobs keys) as ``token_id:N``."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        sampled = entry[token_id]
        text = sampled.decoded_token or ""
        tokens.append(token_name(token_id, text, as_ids))
        token_logprobs.append(max(sampled.logprob, LOGPROB_FLOOR))
        top.append(
            {
                token_name(t, lp.decoded_token, as_ids): max(lp.logprob, LOGPROB_FLOOR)
                for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
            }
        )
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


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
    for name, ok in (("suffix", req.suffix is None), ("echo", not (req.echo and req.logprobs is not None))):
        if not ok:
            raise OpenAIError(
                400,
                f"{name}={getattr(req, name)!r} is not supported"
                + (" together with logprobs" if name == "echo" else ""),
                name,
            )
    prompts = [engine.encode_prompt(p) for p in _prompts(req)]
    lens = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts]
    params = [
        sampling_params(
            req,
            prompt_len=n,
            max_model_len=max_model_len,
            logprobs=req.logprobs,
            max_tokens=req.max_tokens,
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
        return _stream(req, started, request_id, model, engine.tokenizer)
    results, prompt_tokens, completion_tokens = [], 0, 0
    async with merged(started) as outputs:
        async for i, out in outputs:
            if not out.finished:
                continue
            c = out.outputs[0]
            text = c.text
            if req.echo:
                text = (out.prompt or engine.tokenizer.decode(out.prompt_token_ids)) + text
            results.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": completion_logprobs(c, 0, req.return_tokens_as_token_ids),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(out),
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


async def _stream(req: CompletionRequest, started, request_id: str, model: str, tokenizer) -> AsyncIterator[str]:
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
                prompt_tokens[i] = len(out.prompt_token_ids)
                completion_tokens[i] += len(c.token_ids)
                text = c.text
                if not echoed[i]:
                    text, echoed[i] = (out.prompt or tokenizer.decode(out.prompt_token_ids)) + text, True
                logprobs = completion_logprobs(c, offsets[i], req.return_tokens_as_token_ids)
                offsets[i] += len(text)
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                if (
                    logprobs is None
                    and c.finish_reason is None
                    and c.stop_reason is None
                    and out.prompt_logprobs is None
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
                if out.prompt_logprobs is not None:
                    chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(out)
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
