"""The OpenAI-compatible request bodies (with vLLM's extra sampling fields) and error objects.

Requests are pydantic models in strict mode: a wrong type ("max_tokens": "5") is refused, not
coerced, and the error names the field. Unknown fields are accepted and not used (a client may
send fields this server does not know, as with vLLM); each request that has some names them in a
warning of the server's log, as vLLM does. So does a chat message whose role is none of OpenAI's
(it still reaches the chat template, which decides what it means).
Responses are built as plain dicts in the serving modules (their shapes are OpenAI's).
"""

from __future__ import annotations

import logging
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

NonEmptyIds = Annotated[list[int], Field(min_length=1)]


class OpenAIError(Exception):
    """An error answered as OpenAI's error object: ``{"error": {message, type, param, code}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        415: "invalid_request_error",
        422: "invalid_request_error",
        503: "service_unavailable_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class RequestModel(BaseModel):
    """A request body or one of its objects: strict types; fields it does not declare are accepted,
    not used, and named in a warning."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _warn_unused_fields(self):
        if self.model_extra:
            logger.warning(
                "%s: field(s) %s not used by this server (ignored)",
                type(self).__name__,
                ", ".join(map(repr, sorted(self.model_extra))),
            )
        return self


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(RequestModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras (same names as SamplingParams)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM's extra)
    request_id: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | NonEmptyIds | list[str] | list[NonEmptyIds]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message; its other fields (name, tool_calls, ...) go to the chat template as given."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict] | None = None

    @model_validator(mode="after")
    def _warn_unknown_role(self):
        if self.role not in OPENAI_ROLES:
            logger.warning(
                "a chat message's role %r is none of OpenAI's (%s)", self.role, ", ".join(sorted(OPENAI_ROLES))
            )
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # the last message left open, its turn not ended: the model goes on with it (an assistant
    # message's start, "prefill"); not with add_generation_prompt
    continue_final_message: bool = False
    # the last message's content put before each choice's, where its role is the answer's
    echo: bool = False
    chat_template_kwargs: dict | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
