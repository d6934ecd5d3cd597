"""A request body's validation errors as one OpenAI error object naming the field: the server's
400 for a malformed request (api_server.py) and a batch line's (run_batch.py). Imports no web
framework."""

from __future__ import annotations

from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    TokenizeRequest,
)

_REQUEST_FIELDS = (
    set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | set(TokenizeRequest.model_fields)
    | {"role", "content", "include_usage", "continuous_usage_stats", "tokens"}
)


def validation_error(errors: list[dict]) -> OpenAIError:
    """The first of pydantic's ``errors`` (their ``loc`` inside the body), naming the field by its
    path ("messages[0].role"); a union's member types ("prompt.str") are left out of the path."""
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}", "body")
    parts: list[str] = []
    for p in err.get("loc", ()):
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _REQUEST_FIELDS:
            parts.append(("." if parts else "") + p)
    field = "".join(parts) or "body"
    got = "" if err.get("type") == "missing" else f" (got {repr(err.get('input'))[:100]})"
    return OpenAIError(400, f"{field}: {err.get('msg', 'invalid value')}{got}", field)
