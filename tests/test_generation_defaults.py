"""`nanovllm serve --generation-config` / `--override-generation-config` (vLLM's flags): server-wide
sampling defaults for the fields a request leaves out. Their reading and checking, and the order
a request's SamplingParams take them in (the request, then the server, then the endpoint)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic", reason="the serve extra (pydantic, through fastapi) is not installed")

from nanovllm.entrypoints.openai.generation_defaults import sampling_defaults  # noqa: E402
from nanovllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError  # noqa: E402
from nanovllm.entrypoints.openai.serving_common import sampling_params  # noqa: E402


def _model(tmp_path, config: dict | None):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_models_file_is_read_with_transformers_names(tmp_path):
    d = _model(tmp_path, {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_k": 20, "max_new_tokens": 7})
    assert sampling_defaults("auto", None, d) == {"temperature": 0.6, "top_k": 20, "max_tokens": 7}
    assert sampling_defaults("vllm", None, d) == {}  # the engine's own defaults
    assert sampling_defaults("auto", '{"temperature": 0.1, "top_p": 0.5}', d) == {
        "temperature": 0.1,
        "top_k": 20,
        "max_tokens": 7,
        "top_p": 0.5,
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sampling_defaults("auto", None, str(empty)) == {}  # a model without the file
    # transformers' own defaults spelled out are no recommendation (vLLM's to_diff_dict); a null
    # in the override removes the file's value
    (empty / "generation_config.json").write_text('{"top_k": 50, "temperature": 1.0, "top_p": 0.9, "min_p": null}')
    assert sampling_defaults("auto", None, str(empty)) == {"top_p": 0.9}
    assert sampling_defaults("auto", '{"top_p": null}', str(empty)) == {}
    assert sampling_defaults(str(empty / "generation_config.json"), None, d) == {"top_p": 0.9}  # the file itself
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.05, "repetition_penalty": 1.1}')
    assert sampling_defaults(str(other), None, d) == {"min_p": 0.05, "repetition_penalty": 1.1}


@pytest.mark.parametrize(
    "mode, override, said",
    [
        ("vllm", '{"temprature": 0.5}', "unknown key(s) 'temprature'"),
        ("vllm", '{"temperature": -1}', "temperature"),
        ("vllm", '{"max_new_tokens": 0}', "max_new_tokens must be >= 1"),  # the key as the user wrote it
        ("vllm", "temperature=0.5", "--override-generation-config is not JSON"),
        ("vllm", "[1]", "must be a JSON object"),
        ("nowhere", None, "--generation-config must be one of auto, vllm or a folder, got 'nowhere'"),
    ],
)
def test_bad_defaults_stop_the_server_naming_the_flag_and_key(tmp_path, mode, override, said):
    with pytest.raises(ValueError) as e:
        sampling_defaults(mode, override, str(tmp_path))
    assert said in str(e.value), str(e.value)


def test_a_folder_without_the_file_and_an_unreadable_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="has no generation_config.json"):
        sampling_defaults(str(tmp_path), None, str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON.*--generation-config vllm leaves the model's file out"):
        sampling_defaults("auto", None, str(tmp_path))
    assert sampling_defaults("vllm", None, str(tmp_path)) == {}  # the way out the message names
    (tmp_path / "generation_config.json").write_text('{"top_k": 20.5}')
    with pytest.raises(ValueError, match="top_k.*--generation-config vllm"):
        sampling_defaults("auto", None, str(tmp_path))


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
