"""POST /v1/completions: text or token-id prompts (one or a list), plain JSON or server-sent
events (``text_completion`` chunks, then a usage chunk with ``stream_options.include_usage``,
then ``[DONE]``)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from nanovllm.entrypoints.openai.serving_common import (check_model, merged, now, prompt_logprobs_json,
                                                        random_id, sampling_params, sse, start, stream_error,
                                                        usage)
from nanovllm.outputs import CompletionOutput

LOGPROB_FLOOR = -9999.0   # -inf is not JSON: vLLM's floor


def _prompts(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [p]
    if not p:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    return list(p)


def completion_logprobs(c: CompletionOutput, offset: int) -> dict | None:
    """OpenAI's legacy logprobs object for the tokens of ``c`` (text offsets from ``offset``)."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        sampled = entry[token_id]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(max(sampled.logprob, LOGPROB_FLOOR))
        top.append({(lp.decoded_token or ""): max(lp.logprob, LOGPROB_FLOOR)
                    for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


async def create_completion(engine: AsyncLLM, req: CompletionRequest, served: list[str], max_model_len: int):
    """The JSON response (a dict) or an async iterator of SSE lines."""
    check_model(req.model, served)
    for name, ok in (("best_of", req.best_of in (None, 1)), ("suffix", req.suffix is None),
                     ("echo", not (req.echo and req.logprobs is not None))):
        if not ok:
            raise OpenAIError(400, f"{name}={getattr(req, name)!r} is not supported"
                                   + (" together with logprobs" if name == "echo" else ""), name)
    prompts = [engine.encode_prompt(p) for p in _prompts(req)]
    lens = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts]
    params = [sampling_params(req, prompt_len=n, max_model_len=max_model_len, logprobs=req.logprobs,
                              max_tokens=req.max_tokens, default_max_tokens=16, stream=req.stream,
                              prompt_param="prompt") for n in lens]
    request_id = random_id("cmpl")
    started = await start(engine, prompts, params, request_id, "prompt")
    model = req.model or served[0]
    if req.stream:
        return _stream(req, started, request_id, model, engine.tokenizer)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    async with merged(started) as outputs:
        async for i, out in outputs:
            if not out.finished:
                continue
            c = out.outputs[0]
            text = c.text
            if req.echo:
                text = (out.prompt or engine.tokenizer.decode(out.prompt_token_ids)) + text
            choices.append({"index": i, "text": text, "logprobs": completion_logprobs(c, 0),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "prompt_logprobs": prompt_logprobs_json(out)})
            prompt_tokens += len(out.prompt_token_ids)
            completion_tokens += len(c.token_ids)
    choices.sort(key=lambda ch: ch["index"])
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


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
    try:
        async with merged(started) as outputs:
            async for i, out in outputs:
                c = out.outputs[0]
                prompt_tokens[i] = len(out.prompt_token_ids)
                completion_tokens[i] += len(c.token_ids)
                text = c.text
                if not echoed[i]:
                    text, echoed[i] = (out.prompt or tokenizer.decode(out.prompt_token_ids)) + text, True
                logprobs = completion_logprobs(c, offsets[i])
                offsets[i] += len(text)
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}]}
                if out.prompt_logprobs is not None:
                    chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(out)
                if continuous:
                    chunk["usage"] = usage(prompt_tokens[i], completion_tokens[i])
                yield sse(chunk)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(sum(prompt_tokens), sum(completion_tokens))})
    except Exception as e:  # noqa: BLE001 - the response has started: the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
