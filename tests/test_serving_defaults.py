"""How a request's SamplingParams take the server's sampling defaults (`nanovllm serve
--generation-config` / `--override-generation-config`): the request, then the server, then the
endpoint; max_new_tokens a limit. Reading the defaults: tests/core/test_generation_defaults.py."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic", reason="the serve extra (pydantic, through fastapi) is not installed")

from nanovllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError  # noqa: E402
from nanovllm.entrypoints.openai.serving_common import sampling_params  # noqa: E402


def _params(
    body: dict, defaults: dict | None, prompt_len: int = 10, max_model_len: int = 64, endpoint: int | None = 16
):
    """SamplingParams as /v1/completions (``endpoint`` 16, OpenAI's default) or chat (None) builds them."""
    return sampling_params(
        CompletionRequest.model_validate({"prompt": "w5", **body}),
        prompt_len=prompt_len,
        max_model_len=max_model_len,
        logprobs=None,
        max_tokens=body.get("max_tokens"),
        default_max_tokens=endpoint,
        stream=False,
        prompt_param="prompt",
        defaults=defaults,
    )


def test_a_request_then_the_server_then_the_endpoint():
    server = {"temperature": 0.25, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 40}
    p = _params({}, server)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.25, 5, 1.2, 16)
    p = _params({"temperature": 0.9, "top_k": 3, "repetition_penalty": 1.0, "max_tokens": 4}, server)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.9, 3, 1.0, 4)  # the request wins
    p = _params({"temperature": 0.0}, server)  # 0 is a value, not "left out"
    assert p.temperature == 0.0
    # max_new_tokens is a limit (vLLM's meaning): on a request's own max_tokens and on chat's
    # default (the rest of the context), never raising completions' 16
    assert _params({"max_tokens": 50}, server, max_model_len=100).max_tokens == 40
    assert _params({}, server, endpoint=None).max_tokens == 40
    assert _params({}, {}, endpoint=None).max_tokens == 54  # without it: the rest of the context
    assert _params({}, server, prompt_len=50, endpoint=None).max_tokens == 14
    assert _params({}, {"max_tokens": 8}).max_tokens == 8
    p, bare = _params({}, {}), _params({}, None)
    assert p.max_tokens == bare.max_tokens == 16  # the endpoint's default (OpenAI's 16)
    assert (p.temperature, p.top_k) == (bare.temperature, bare.top_k) == (1.0, 0)  # the engine's defaults
    with pytest.raises(OpenAIError):  # a request's bad value is still its own 400
        _params({"temperature": -1.0}, server)
