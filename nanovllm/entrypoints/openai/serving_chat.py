"""POST /v1/chat/completions: the tokenizer's chat template (as ``LLM.chat``), ``n`` choices,
plain JSON or server-sent events (``chat.completion.chunk``: per choice a role chunk, content
deltas, the finish reason; then a usage chunk with ``stream_options.include_usage``, then
``[DONE]``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.entrypoints.openai.completion_logprobs import LOGPROB_FLOOR, token_name
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from nanovllm.entrypoints.openai.serving_common import (
    check_model,
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

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


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
                    raise OpenAIError(
                        400,
                        f"only text content parts are supported, got type {part.get('type')!r}",
                        f"messages[{i}].content[{j}]",
                    )
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        messages.append(d)
    return messages


def refuse_request_template(req) -> None:
    """A request's own template (vLLM's opt-in ``--trust-request-chat-template``), as a field or in
    ``chat_template_kwargs``, is a 400 naming it: run unasked, it would render the prompt with
    another template than the one served (``null`` sets nothing, as in vLLM)."""
    if (req.model_extra or {}).get("chat_template") is not None:
        raise OpenAIError(
            400,
            "a request cannot set chat_template on this server: start it with --chat-template",
            "chat_template",
        )
    if (req.chat_template_kwargs or {}).get("chat_template") is not None:
        raise OpenAIError(
            400,
            "chat_template_kwargs may not set chat_template: a request cannot replace the server's template "
            "(start the server with --chat-template)",
            "chat_template_kwargs",
        )


def apply_chat_template(tokenizer, req: ChatCompletionRequest, chat_template: str | None = None) -> dict:
    """{'prompt', 'prompt_token_ids'}: the same ids as ``LLM.chat`` for the same conversation;
    ``chat_template``: the server's template (``--chat-template``) instead of the model's own."""
    refuse_request_template(req)
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError(
            400,
            "this model has no chat template: use /v1/completions, or start the server with --chat-template",
            "messages",
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise OpenAIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: the last message is "
            "either continued or answered (set add_generation_prompt to false)",
            "continue_final_message",
        )
    try:
        ids = tokenizer.apply_chat_template(
            conversation(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            tokenize=True,
            return_dict=False,
            # the request's chat_template_kwargs win over its flags, as in vLLM
            **{
                **({"continue_final_message": True} if req.continue_final_message else {}),
                **{k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"},
                **({"chat_template": chat_template} if chat_template is not None else {}),
            },
        )
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error (jinja raise_exception, bad kwargs) is the caller's
        raise OpenAIError(400, f"the chat template failed on these messages: {e}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False), "prompt_token_ids": list(ids)}


def answer_role(req: ChatCompletionRequest) -> str:
    """The answer's role: the assistant's after a generation prompt, else the last message's (the
    model goes on in that turn), as vLLM answers."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echoed(req: ChatCompletionRequest) -> str:
    """With ``echo``, the last message's content where its role is the answer's (what the answer
    goes on from), else nothing."""
    if not req.echo or req.messages[-1].role != answer_role(req):
        return ""
    return conversation(req.messages[-1:])[0]["content"]


def chat_logprobs(c: CompletionOutput, top: int, as_ids: bool = False) -> dict | None:
    """OpenAI's chat logprobs; ``as_ids``: each token as ``token_id:N`` (its bytes stay its text's)."""
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        sampled = entry[token_id]
        best = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top), key=lambda kv: kv[1].rank)[:top]
        content.append(
            {
                "token": token_name(token_id, sampled.decoded_token, as_ids),
                "logprob": max(sampled.logprob, LOGPROB_FLOOR),
                "bytes": list((sampled.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": token_name(t, lp.decoded_token, as_ids),
                        "logprob": max(lp.logprob, LOGPROB_FLOOR),
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for t, lp in best
                ],
            }
        )
    return {"content": content}


async def create_chat_completion(
    engine: AsyncLLM,
    req: ChatCompletionRequest,
    served: list[str],
    max_model_len: int,
    defaults: dict | None = None,
    chat_template: str | None = None,
):
    """The JSON response (a dict) or an async iterator of SSE lines; ``chat_template``: the
    server's (``--chat-template``), else the model's own."""
    check_model(req.model, served)
    refuse_constraints(req)
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt = apply_chat_template(engine.tokenizer, req, chat_template)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(
        req,
        prompt_len=len(prompt["prompt_token_ids"]),
        max_model_len=max_model_len,
        logprobs=(top or 0) if req.logprobs else None,
        max_tokens=max_tokens,
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        default_max_tokens=None,
        stream=req.stream,
        prompt_param="messages",
        defaults=defaults,
    )
    request_id = random_id("chatcmpl")
    started = await start(engine, [prompt] * req.n, choices(params, req.n), request_id, "messages")
    model = req.model or served[0]
    if req.stream:
        return _stream(req, started, request_id, model, top or 0)
    role, echo = answer_role(req), echoed(req)
    results, completion_tokens = [], 0
    async with merged(started) as outputs:
        async for i, out in outputs:
            if not out.finished:
                continue
            c = out.outputs[0]
            results.append(
                {
                    "index": i,
                    "message": {"role": role, "content": echo + c.text},
                    "logprobs": chat_logprobs(c, top or 0, req.return_tokens_as_token_ids),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            completion_tokens += len(c.token_ids)
    results.sort(key=lambda ch: ch["index"])
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": results,
        "usage": usage(len(out.prompt_token_ids), completion_tokens),
    }
    if out.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(out)
    return response


async def _stream(req: ChatCompletionRequest, started, request_id: str, model: str, top: int) -> AsyncIterator[str]:
    created = now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    prompt_tokens = 0
    completion_tokens = [0] * len(started)  # per choice
    as_ids = req.return_tokens_as_token_ids
    role, echo = answer_role(req), echoed(req)

    def chunk(i: int, delta: dict, c: CompletionOutput | None = None) -> dict:
        d = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "delta": delta,
                    "logprobs": chat_logprobs(c, top, as_ids) if c else None,
                    "finish_reason": c.finish_reason if c else None,
                    "stop_reason": c.stop_reason if c else None,
                }
            ],
        }
        if continuous:
            d["usage"] = usage(prompt_tokens, completion_tokens[i])
        return d

    chunks = StreamChunks(request_id, "chat.completion.chunk", created, model)
    try:
        first = [True] * len(started)
        async with merged(started) as outputs:
            async for i, out in outputs:
                c = out.outputs[0]
                prompt_tokens = len(out.prompt_token_ids)
                completion_tokens[i] += len(c.token_ids)
                if first[i]:
                    first[i] = False
                    yield sse(chunk(i, {"role": role, "content": ""}))
                    if echo:
                        yield sse(chunk(i, {"content": echo}))
                if (
                    c.text
                    and c.logprobs is None
                    and c.finish_reason is None
                    and c.stop_reason is None
                    and not continuous
                ):
                    yield chunks.content(i, c.text)  # most chunks: the same bytes as the line below, faster
                elif c.text or c.finish_reason is not None or c.logprobs:
                    yield sse(chunk(i, {"content": c.text} if c.text else {}, c))
        if include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(prompt_tokens, sum(completion_tokens)),
                }
            )
    except Exception as e:  # noqa: BLE001 - the response has started: the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
