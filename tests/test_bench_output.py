"""bench's outputs: --json-out files are strict JSON (an infinite request rate, bench serve's default,
was written as a bare Infinity, which JSON parsers refuse); a refused request's times."""

from __future__ import annotations

import json
import math

import pytest

from nanovllm.bench.json_out import finite, write_json


def test_non_finite_floats_are_written_as_strings(tmp_path):
    path = tmp_path / "r.json"
    write_json(str(path), {"request_rate": math.inf, "rows": [{"x": -math.inf, "y": math.nan, "z": 1.5}], "t": (1, 2)})
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    assert data == {"request_rate": "inf", "rows": [{"x": "-inf", "y": "nan", "z": 1.5}], "t": [1, 2]}


def test_the_control_plain_json_dump_writes_what_parsers_refuse():
    assert json.dumps({"request_rate": math.inf}) == '{"request_rate": Infinity}'
    assert finite({"a": [math.inf]}) == {"a": ["inf"]}


def test_a_refused_request_has_its_end_time():
    """bench serve's timeline: a request the server refused (HTTP 400) ends when its answer came,
    not at 0 (the run's 'last byte' read -57990 s when every request was refused)."""
    import asyncio

    pytest.importorskip("aiohttp", reason="the serve extra (aiohttp) is not installed")
    from aiohttp import web

    from tests.scripted_server import one_request_against

    async def refuse(request):
        return web.json_response({"error": {"message": "no"}}, status=400)

    before, r, after = asyncio.run(one_request_against(refuse))
    assert not r.ok and r.error.startswith("HTTP 400")
    assert before <= r.sent_at <= r.done_at <= after, (before, r.sent_at, r.done_at, after)


def test_bench_serve_against_a_url_takes_the_served_models_vocabulary(monkeypatch, tmp_path):
    """bench serve --base-url without --model: the random prompts come from the served model's
    vocabulary (its /v1/models root), not the local default model's, whose ids a server of another
    model refused (every request failed). A root not on this machine asks for --model."""
    httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
    import nanovllm.bench.serve as serve_mod
    from conformance.zoo import zoo_model
    from nanovllm.entrypoints.cli import build_parser

    root = zoo_model("qwen3-gqa2-hd64-tied")  # vocabulary 1031
    seen = {}

    def fake_get(url, headers=None, timeout=None):
        seen["url"] = url
        return httpx.Response(200, json={"data": [{"id": "m", "root": served}]}, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", fake_get)
    monkeypatch.setattr(serve_mod, "_measured", lambda label, url, model, w, args: pytest.fail(repr(w.prompts)))
    served = root
    assert serve_mod.served_model_dir("http://127.0.0.1:1/") == root and seen["url"] == "http://127.0.0.1:1/v1/models"
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--dataset", "random", "--num-prompts", "8"]
        + ["--input-len", "64", "--output-len", "2"]
    )
    with pytest.raises(pytest.fail.Exception) as e:  # _measured sees the workload: ids below 1031
        serve_mod.run_bench_serve(args)
    ids = [int(t) for t in e.value.msg.replace("[", " ").replace("]", " ").replace(",", " ").split()]
    assert len(ids) == 8 * 64 and max(ids) < 1031, max(ids)
    served = "meta-llama/elsewhere"  # the control: a model not on this machine
    with pytest.raises(ValueError, match="serves 'meta-llama/elsewhere', which is not a folder or file on this"):
        serve_mod.served_model_dir("http://127.0.0.1:1")
