"""`nanovllm serve --generation-config` / `--override-generation-config` (vLLM's flags): reading and
checking the server-wide sampling defaults (torch-free: mutmut runs these for
``generation_defaults.py``; tests/test_serving_defaults.py has how a request takes them)."""

from __future__ import annotations

import json
import logging

import pytest

from nanovllm.entrypoints.openai.generation_defaults import sampling_defaults
from nanovllm.sampling_params import SamplingParams


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


def test_a_null_override_removes_a_key_named_otherwise_in_the_file(tmp_path):
    """``--override-generation-config '{"max_new_tokens": null}'`` removes the file's limit, as a
    null does for a key spelled alike in the file and in SamplingParams (top_k here): the override
    takes the file's names, and the default is kept under SamplingParams' name (max_tokens), so the
    null must remove that one; the other keys stay."""
    d = _model(tmp_path, {"temperature": 0.6, "top_k": 20, "max_new_tokens": 7})
    assert sampling_defaults("auto", None, d) == {"temperature": 0.6, "top_k": 20, "max_tokens": 7}  # the control
    assert sampling_defaults("auto", '{"max_new_tokens": null}', d) == {"temperature": 0.6, "top_k": 20}
    assert sampling_defaults("auto", '{"top_k": null, "max_new_tokens": null}', d) == {"temperature": 0.6}


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


def _error(*args) -> str:
    with pytest.raises(ValueError) as e:
        sampling_defaults(*args)
    return str(e.value)


def _sampling_params_error(**fields) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    return str(e.value)


def test_messages_name_the_flag_the_path_the_key_and_the_way_out(tmp_path):
    """The start-up errors, whole: each names the flag, the path or key the user gave, and (for the
    model's own file) how to leave it out."""
    way_out = "--generation-config vllm leaves the model's file out"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text("[1, 2]")
    assert _error("auto", None, str(bad)) == (
        f"--generation-config: {str(bad / 'generation_config.json')!r} holds list, not a JSON object ({way_out})"
    )
    (bad / "generation_config.json").write_text("{oops")
    said = _error("auto", None, str(bad))
    assert said.startswith(f"--generation-config: {str(bad / 'generation_config.json')!r} is not readable JSON: ")
    assert said.endswith(f"({way_out})"), said
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        _error(str(empty), None, str(tmp_path)) == f"--generation-config: {str(empty)!r} has no generation_config.json"
    )
    other = tmp_path / "other.json"  # a file, but not a generation_config.json: not taken for its folder
    other.write_text("{}")
    assert _error(str(other), None, str(tmp_path)).startswith(
        "--generation-config must be one of auto, vllm or a folder"
    )
    assert _error("vllm", '{"b": 1, "a": 2}', str(tmp_path)) == (
        "--override-generation-config: unknown key(s) 'a', 'b'; "
        "known: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens"
    )
    assert _error("vllm", '{"temperature": -1}', str(tmp_path)) == (
        f"server sampling defaults (--override-generation-config): {_sampling_params_error(temperature=-1)}"
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text('{"top_p": 1.5}')
    assert _error("auto", None, str(model)) == (
        f"server sampling defaults (the model's generation_config.json): {_sampling_params_error(top_p=1.5)}; {way_out}"
    )
    assert _error(str(model), '{"top_k": 2}', str(tmp_path)) == (
        f"server sampling defaults ({model} and --override-generation-config): "
        f"{_sampling_params_error(top_p=1.5)}; {way_out}"
    )
    assert sampling_defaults("vllm", '{"top_p": null}', str(model)) == {}  # null for a key not set: no error


def test_the_start_up_log_says_what_is_applied_and_from_where(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="nanovllm.entrypoints.openai.generation_defaults")
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    head = "sampling defaults for requests that leave the field out (max_tokens: a limit on every request): "
    sampling_defaults("auto", '{"top_k": 5}', str(tmp_path))
    sampling_defaults("vllm", '{"top_k": 5}', str(tmp_path))
    sampling_defaults("vllm", None, str(tmp_path))  # nothing applied: nothing logged
    sampling_defaults("auto", None, str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        head + "{'temperature': 0.6, 'top_k': 5}, from the model's generation_config.json and "
        "--override-generation-config (--generation-config vllm leaves the model's file out)",
        head + "{'top_k': 5}, from --override-generation-config",
        head + "{'temperature': 0.6}, from the model's generation_config.json "
        "(--generation-config vllm leaves the model's file out)",
    ]


def test_a_file_that_gives_nothing_is_not_named_as_a_source(tmp_path, caplog):
    """A model file with no sampling keys (the default model's) is no source of the defaults: the
    log and the errors name the override alone, without the way out of the file (a user's trial saw
    "from the model's generation_config.json" for an override-only default)."""
    caplog.set_level(logging.WARNING, logger="nanovllm.entrypoints.openai.generation_defaults")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "top_k": 50}')
    sampling_defaults("auto", '{"temperature": 0}', str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        "sampling defaults for requests that leave the field out (max_tokens: a limit on every request): "
        "{'temperature': 0}, from --override-generation-config"
    ]
    assert _error("auto", '{"temperature": -1}', str(tmp_path)) == (
        f"server sampling defaults (--override-generation-config): {_sampling_params_error(temperature=-1)}"
    )
