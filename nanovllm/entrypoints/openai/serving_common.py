"""What both OpenAI endpoints share: request -> SamplingParams (with the length checks vLLM
makes), starting requests so that a bad one is a 400 before any byte is sent, merging the
streams of several prompts, usage, server-sent events.

``n`` completions per prompt: the server starts n engine requests per prompt, choice
``i * n + j`` being prompt i's completion j, with the engine's rule for seeds (completion j draws
with ``seed + j``, as ``engine/parallel_sampling.py`` does for ``SamplingParams.n``), so a seeded
n > 1 request equals offline ``LLM.generate`` with the same n and seed; greedy n > 1 (which
OpenAI allows) gives n equal choices. Each choice is an engine request of its own, so the
/metrics figures count choices (finished requests, generated tokens, and the prompt tokens of
each), as vLLM's do for its child requests; a response's usage counts each prompt once and the
tokens of every choice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError
from nanovllm.entrypoints.openai.completion_logprobs import most_likely
from nanovllm.entrypoints.openai.protocol import OpenAIError, SamplingFields
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams, child_seed

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# OpenAI's and vLLM's names -> the value that means "off" (passed through once SamplingParams has them)
_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
MAX_N = 128  # OpenAI's limit on n
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range; vLLM clamps a bias into it


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def param_of(message: str, default: str | None) -> str | None:
    """The request field an error message names (messages start with the field), else ``default``."""
    m = re.match(r"(\w+)", message)
    if m and (m.group(1) in SamplingFields.model_fields or m.group(1) in ("prompt", "messages", "logprobs", "best_of")):
        return m.group(1)
    return default


def check_model(req_model: str | None, served: list[str]) -> None:
    if req_model is not None and req_model not in served:
        raise OpenAIError(
            404, f"The model `{req_model}` does not exist. Served: {', '.join(served)}.", "model", "model_not_found"
        )


def sampling_params(
    req: SamplingFields,
    *,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    max_tokens: int | None,
    default_max_tokens: int | None,
    stream: bool,
    prompt_param: str,
    defaults: dict | None = None,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """SamplingParams for one prompt (with n = 1: ``choices`` fans out n), or OpenAIError(400)
    naming the field. ``defaults``: the server's values for sampling fields the request leaves out,
    and its ``max_tokens``, a limit on every request (``generation_defaults.py``).
    ``max_tokens_param``: the request's field that gave ``max_tokens`` (chat: max_completion_tokens
    wins over max_tokens), which its errors name."""
    defaults = defaults or {}
    check_n(req.n)
    if prompt_len >= max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            prompt_param,
        )
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_model_len - prompt_len
    elif isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise OpenAIError(
            400,
            f"{max_tokens_param}={max_tokens} is too large: this model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({prompt_len + max_tokens} > {max_model_len})",
            max_tokens_param,
        )
    limit = defaults.get("max_tokens")
    if limit is not None and isinstance(max_tokens, int) and max_tokens > limit:
        max_tokens = limit  # the server's limit (max_new_tokens), as vLLM applies it
    kwargs: dict = dict(
        max_tokens=max_tokens,
        logprobs=logprobs,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        seed=req.seed,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=logit_bias(req.logit_bias),
        bad_words=req.bad_words,
        allowed_token_ids=req.allowed_token_ids,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", *_PENALTIES):
        value = getattr(req, name)
        value = defaults.get(name) if value is None else value
        if value is None:
            continue
        if name in _SAMPLING_FIELDS:
            kwargs[name] = value
        elif value != _PENALTIES[name]:  # a penalty the engine lacks takes only its "off" value
            raise OpenAIError(400, f"{name}={value} is not supported by this engine (only {_PENALTIES[name]})", name)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, str(e), param_of(str(e), None)) from None


# Fields that constrain what the answer must be (a JSON object, a tool call, a grammar): the server
# cannot honour them, and answering with free text as if it had would break the client. A value
# that asks for nothing (response_format "text", no tools, tool_choice "none") is accepted.
_HARMLESS = {
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
}


def refuse_constraints(req) -> None:
    """400 naming the first field of ``_HARMLESS`` the request sets to a constraint (vLLM honours
    them; this server has no structured output or tool calling)."""
    for name, value in (req.model_extra or {}).items():
        if name in _HARMLESS and not _HARMLESS[name](value):
            raise OpenAIError(
                400,
                f"{name}={_short(value)} is not supported by this server (no structured output or tool "
                "calling): leave it out",
                name,
            )


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise OpenAIError(400, f"n must be in [1, {MAX_N}], got {n}", "n")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as string keys) -> SamplingParams' (int keys), each bias
    clamped into [-100, 100] as vLLM does; a key that is not a token id or a value that is not
    finite is a 400 naming the field. Ids outside the vocabulary are the engine's 400."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d+", key.strip()):
            raise OpenAIError(
                400, f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}", "logit_bias"
            )
        if not math.isfinite(value):
            raise OpenAIError(400, f"logit_bias[{key!r}] must be a finite number, got {value!r}", "logit_bias")
        out[int(key)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One prompt's n choices: completion j draws with ``seed + j`` (the engine's rule for n > 1)."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=child_seed(params.seed, j)) for j in range(n)]


async def start(
    engine: AsyncLLM, prompts: list, params: list[SamplingParams], request_id: str, prompt_param: str
) -> list[tuple[AsyncIterator[RequestOutput], RequestOutput]]:
    """Add every prompt's request and wait for its first output, so a request the engine refuses
    is a 400 (naming the field) before the response starts; on any error none is left running."""
    gens = [engine.generate(p, sp, f"{request_id}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    errors = [e for e in firsts if isinstance(e, BaseException)]
    if errors:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        e = errors[0]
        if isinstance(e, (ValueError, TypeError)):
            raise OpenAIError(400, str(e), param_of(str(e), prompt_param)) from None
        if isinstance(e, EngineDeadError):
            raise OpenAIError(503, str(e)) from None
        raise e
    return list(zip(gens, firsts))  # type: ignore[arg-type]  # the errors were raised above


def merged(started) -> contextlib.aclosing:
    """``async with merged(started) as outputs``: (prompt index, output) from several started
    requests, as they come; leaving the block (or an error) closes them all, aborting the
    unfinished ones."""
    return contextlib.aclosing(_merged(started))


async def _merged(started) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(started) == 1:
        gen, first = started[0]
        try:
            yield 0, first
            if not first.finished:
                async for out in gen:
                    yield 0, out
        finally:
            await gen.aclose()  # at once, not when collected: closing aborts an unfinished request
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen, first):
        try:
            await queue.put((i, first))
            if not first.finished:
                async for out in gen:
                    await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(started)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g, _ in started), return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error(e: BaseException) -> str:
    status = 503 if isinstance(e, EngineDeadError) else 500
    return sse(OpenAIError(status, f"{type(e).__name__}: {e}").body())


def prompt_logprobs_json(out: RequestOutput, k: int | None = None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position, {token id: {logprob, rank, decoded_token}};
    ``k``: each position kept to its k most likely tokens and the prompt's own."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if d is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in most_likely(d, token_id, k).items()
        }
        for token_id, d in zip(out.prompt_token_ids, out.prompt_logprobs)
    ]
