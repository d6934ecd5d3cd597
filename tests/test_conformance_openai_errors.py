"""The openai adapter's start-up errors: one line each, naming the variable to change (against a
fake server: httpx's MockTransport)."""

from __future__ import annotations

import httpx
import pytest

from conformance.adapters import openai_adapter
from conformance.adapters.openai_adapter import OpenAIAdapter

MODELS = {"data": [{"id": "llama", "owned_by": "vllm"}, {"id": "qwen", "owned_by": "vllm"}]}


@pytest.fixture
def server(monkeypatch):
    """serve(routes): the adapter's client talks to a fake server answering GET paths from ``routes``."""
    for var in ("CONFORMANCE_OPENAI_MODEL", "CONFORMANCE_OPENAI_SERVER", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)

    def serve(routes: dict, base: str = "http://fake/v1") -> None:
        monkeypatch.setenv("CONFORMANCE_OPENAI_BASE_URL", base)

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path in routes:
                return httpx.Response(200, json=routes[request.url.path])
            return httpx.Response(404, json={"detail": "Not Found"})

        monkeypatch.setattr(
            openai_adapter, "_client", lambda: httpx.Client(base_url=base, transport=httpx.MockTransport(handler))
        )

    return serve


def test_a_url_without_v1_gets_the_hint(server):
    server({"/v1/models": MODELS}, base="http://fake")
    why = OpenAIAdapter.unavailable()
    assert "answered 404" in why and "does the URL end in /v1?" in why, why
    server({"/v1/models": MODELS})  # control: the same server at .../v1
    assert OpenAIAdapter.unavailable() is None


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(server, monkeypatch):
    server({"/v1/models": MODELS})
    monkeypatch.setenv("CONFORMANCE_OPENAI_MODEL", "wrongname")
    why = OpenAIAdapter.unavailable()
    assert why == "model 'wrongname' (CONFORMANCE_OPENAI_MODEL) not served; the server has: llama, qwen", why
    monkeypatch.setenv("CONFORMANCE_OPENAI_MODEL", "qwen")  # control
    assert OpenAIAdapter.unavailable() is None


def test_an_unknown_server_kind_names_its_variable_and_values(server, monkeypatch):
    server({"/v1/models": MODELS})
    monkeypatch.setenv("CONFORMANCE_OPENAI_SERVER", "sglang")
    why = OpenAIAdapter.unavailable()
    assert "CONFORMANCE_OPENAI_SERVER='sglang'" in why and "vllm, nanovllm, llama-cpp, generic" in why, why
    assert "CONFORMANCE_OPENAI_BASE_URL" not in why
    monkeypatch.setenv("CONFORMANCE_OPENAI_SERVER", "vLLM")  # control: the name in any case
    assert OpenAIAdapter.unavailable() is None


def test_no_server_is_one_line(monkeypatch):
    monkeypatch.setenv("CONFORMANCE_OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # the discard port: refused

    def refuse(request):
        raise httpx.ConnectError("All connection attempts failed\nsecond line\nthird line")

    monkeypatch.setattr(openai_adapter, "_client", lambda: httpx.Client(transport=httpx.MockTransport(refuse)))
    why = OpenAIAdapter.unavailable()
    assert "\n" not in why and "All connection attempts failed" in why and "CONFORMANCE_OPENAI_BASE_URL" in why, why
