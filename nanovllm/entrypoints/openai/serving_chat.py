"""POST /v1/chat/completions: the tokenizer's chat template (as ``LLM.chat``), plain JSON or
server-sent events (``chat.completion.chunk``: a role chunk, content deltas, the finish reason,
then a usage chunk with ``stream_options.include_usage``, then ``[DONE]``)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from nanovllm.entrypoints.openai.serving_common import (check_model, merged, now, prompt_logprobs_json,
                                                        random_id, sampling_params, sse, start, stream_error,
                                                        usage)
from nanovllm.entrypoints.openai.serving_completion import LOGPROB_FLOOR
from nanovllm.outputs import CompletionOutput

MAX_TOP_LOGPROBS = 20   # OpenAI's limit


def conversation(req_messages) -> list[dict]:
    """Messages as the chat template takes them: content parts of type text are joined."""
    messages = []
    for i, m in enumerate(req_messages):
        d = m.model_dump(exclude_none=True)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(400, f"only text content parts are supported, got type "
                                           f"{part.get('type')!r}", f"messages[{i}].content[{j}]")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        messages.append(d)
    return messages


def apply_chat_template(tokenizer, req: ChatCompletionRequest) -> dict:
    """{'prompt', 'prompt_token_ids'}: the same ids as ``LLM.chat`` for the same conversation."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(conversation(req.messages), add_generation_prompt=req.add_generation_prompt,
                                            tokenize=True, return_dict=False, **(req.chat_template_kwargs or {}))
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error (jinja raise_exception, bad kwargs) is the caller's
        raise OpenAIError(400, f"the chat template failed on these messages: {e}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False), "prompt_token_ids": list(ids)}


def chat_logprobs(c: CompletionOutput, top: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        sampled = entry[token_id]
        best = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
        content.append({"token": sampled.decoded_token or "", "logprob": max(sampled.logprob, LOGPROB_FLOOR),
                        "bytes": list((sampled.decoded_token or "").encode()),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": max(lp.logprob, LOGPROB_FLOOR),
                                          "bytes": list((lp.decoded_token or "").encode())} for lp in best]})
    return {"content": content}


async def create_chat_completion(engine: AsyncLLM, req: ChatCompletionRequest, served: list[str],
                                 max_model_len: int):
    """The JSON response (a dict) or an async iterator of SSE lines."""
    check_model(req.model, served)
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt = apply_chat_template(engine.tokenizer, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, prompt_len=len(prompt["prompt_token_ids"]), max_model_len=max_model_len,
                             logprobs=(top or 0) if req.logprobs else None, max_tokens=max_tokens,
                             default_max_tokens=None, stream=req.stream, prompt_param="messages")
    request_id = random_id("chatcmpl")
    started = await start(engine, [prompt], [params], request_id, "messages")
    model = req.model or served[0]
    if req.stream:
        return _stream(req, started, request_id, model, top or 0)
    async with merged(started) as outputs:
        async for _, out in outputs:
            if out.finished:
                break
    c = out.outputs[0]
    choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
              "logprobs": chat_logprobs(c, top or 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    response = {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
                "choices": [choice], "usage": usage(len(out.prompt_token_ids), len(c.token_ids))}
    if out.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(out)
    return response


async def _stream(req: ChatCompletionRequest, started, request_id: str, model: str, top: int) -> AsyncIterator[str]:
    created = now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    prompt_tokens = completion_tokens = 0

    def chunk(delta: dict, c: CompletionOutput | None = None) -> dict:
        d = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(c, top) if c else None,
                          "finish_reason": c.finish_reason if c else None,
                          "stop_reason": c.stop_reason if c else None}]}
        if continuous:
            d["usage"] = usage(prompt_tokens, completion_tokens)
        return d

    try:
        first = True
        async with merged(started) as outputs:
            async for _, out in outputs:
                c = out.outputs[0]
                prompt_tokens = len(out.prompt_token_ids)
                completion_tokens += len(c.token_ids)
                if first:
                    first = False
                    yield sse(chunk({"role": "assistant", "content": ""}))
                if c.text or c.finish_reason is not None or c.logprobs:
                    yield sse(chunk({"content": c.text} if c.text else {}, c))
        if include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except Exception as e:  # noqa: BLE001 - the response has started: the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
